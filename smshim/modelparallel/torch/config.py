"""The smp configuration: merge the init() dict with SM_HP_MP_PARAMETERS, validate, derive defaults.

`resolve_config(user, world_size, env)` is pure: the same input gives the same SMPConfig or the same
exception on every rank, so a bad configuration fails everywhere before any collective can hang.

Merge. Each source (the dict given to `smp.init`, the JSON in `SM_HP_MP_PARAMETERS`) is normalised
on its own first: `partitions` is an alias of `pipeline_parallel_degree`; giving both in one source
with different values is an error. Then the environment's keys override the dict's (logged when a
value changes).

Validation order (the first failure raises): the sources' shape, unknown keys, types, ranges,
dependencies, Adv features, world size. Types: ints and bools are distinct (True is not an int);
a float key (memory_weight) accepts an int, as JSON writes 1.0 as 1. `None` means "the default"
only for the keys whose default is derived: memory_weight, active_microbatches, ddp_port.

Dependencies and the choices made where SPEC leaves room:
  * auto_partition False needs default_partition to be given explicitly (SPEC: "False needs
    default_partition"), so a manual partitioning never lands on partition 0 by accident.
    default_partition given with auto_partition True is accepted and unused (as in SageMaker).
  * ddp_port and ddp_dist_backend, when given at all, need ddp True.
  * horovod with ddp is an error (SMPConfigError); horovod alone is an Adv rejection.
  * pipeline "simple" runs every microbatch's forward before any backward, so it needs
    active_microbatches == microbatches. If active_microbatches is not given, "simple" sets it to
    microbatches. If it is given explicitly and differs, the pipeline is switched to "interleaved"
    and a warning says so (SPEC §2 "Schedules"); an active_microbatches outside
    [1, microbatches] is an error either way.
  * memory_weight defaults to 0.8 with optimize "memory", 0.2 with "speed"; an explicit value wins.
  * active_microbatches defaults to min(pipeline_parallel_degree + 2, microbatches).
  * ddp_port defaults to MASTER_PORT (None when unset); it must be in [0, 65535].
  * world size: `size % (pp * tp) != 0` is an error; size > pp * tp needs ddp.

Adv keys (SPEC §3), decided one by one. Implemented: fp16 / bf16 (the model runs in that dtype,
DistributedOptimizer keeps fp32 master weights and scales the loss; mixed_precision.py), fp16_params
(needs fp16), shard_optimizer_state (needs ddp; optimizer_sharding.py); fp16 with bf16 is an error
naming both. tensor_parallel_degree (smp.nn, tensor_parallel/replace.py) with prescaled_batch: false, the
TP ranks of a group hold different batches that the distributed modules gather; true, they hold
the same batch (with tp = 1 it changes nothing, since rdp == dp). Rejected with
SMPUnsupportedError (a NotImplementedError) naming the key when set to a non-default value,
because accepting them would silently change the meaning of training:
  horovod.
sharded_data_parallel_degree k > 1 runs the model under torch's FSDP (sharded_data_parallel/):
needs ddp, pipeline_parallel_degree 1, no shard_optimizer_state, a world size that k divides;
with tensor parallelism it is rejected (SMPUnsupportedError) for now; fp16/bf16 compute in that
dtype on fp32 shards (FSDP MixedPrecision). Its
sdp_gradient_clipping is the threshold the optimizer clips the global gradient norm to before
every step (0 turns it off); the other sdp_* keys tune SageMaker's engine (no effect here).
Accepted with any valid value, because they cannot change results here:
  contiguous (our partitions are always contiguous, which is one valid outcome of either
  setting), tensor_parallel_seed (smp.nn shards are cut from a full initialisation drawn from
  torch's RNG, the same on ranks seeded alike).
Accepted and logged once (INFO) as having no effect, because they only tune the speed or memory
of SageMaker's own engine (`NO_EFFECT`); their types and ranges are still validated:
  fast_mode, static_mode (SMP >= 1.10 execution-mode hints), skip_tracing (a partitioning-cost
  hint; any partition is correct), offload_activations and activation_loading_horizon
  (activations kept on the device instead of offloaded to host memory: the same values),
  delayed_parameter_initialization (parameters are created where the module is built; the values
  come from the same RNG draws), and the sharded-data-parallel tuning keys sdp_reduce_bucket_size,
  sdp_param_persistence_threshold, sdp_max_live_parameters, sdp_hierarchical_allgather.
The "count" keys (sdp sizes) are documented with defaults such as 5e8, so an integral float (as
Python and JSON write 5e8) is accepted and stored as an int.
"""

from __future__ import annotations

import difflib
import json
import logging
import numbers
import os
from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional, Set, Tuple

from smshim.modelparallel.torch.errors import SMPConfigError, SMPUnsupportedError

logger = logging.getLogger(__name__)

__all__ = ["SMPConfig", "SMPConfigError", "resolve_config", "ENV_VAR", "ALIASES"]

ENV_VAR = "SM_HP_MP_PARAMETERS"
ALIASES = {"partitions": "pipeline_parallel_degree"}

PIPELINES = ("interleaved", "simple")
OPTIMIZE = ("speed", "memory")
DDP_BACKENDS = ("auto", "nccl", "gloo")
PLACEMENT_WORDS = ("cluster", "spread")
MEMORY_WEIGHT = {"memory": 0.8, "speed": 0.2}


@dataclass
class SMPConfig:
    """One field per configuration key of SPEC §3, after defaults and derived defaults."""

    pipeline_parallel_degree: int = 1
    microbatches: int = 1
    pipeline: str = "interleaved"
    optimize: str = "speed"
    placement_strategy: str = "cluster"
    auto_partition: bool = True
    default_partition: int = 0
    memory_weight: float = 0.2
    active_microbatches: int = 1
    deterministic_server: bool = False
    ddp: bool = False
    ddp_port: Optional[int] = None
    ddp_dist_backend: str = "auto"
    horovod: bool = False
    tensor_parallel_degree: int = 1
    fp16: bool = False
    bf16: bool = False
    shard_optimizer_state: bool = False
    offload_activations: bool = False
    activation_loading_horizon: int = 4
    prescaled_batch: bool = False
    delayed_parameter_initialization: bool = False
    skip_tracing: bool = False
    sharded_data_parallel_degree: int = 1
    tensor_parallel_seed: int = 0
    contiguous: bool = True
    fp16_params: bool = False
    fast_mode: bool = False
    static_mode: bool = False
    sdp_reduce_bucket_size: int = 500_000_000
    sdp_param_persistence_threshold: int = 1_000_000
    sdp_max_live_parameters: int = 1_000_000_000
    sdp_hierarchical_allgather: bool = True
    sdp_gradient_clipping: float = 1.0

    @property
    def partitions(self) -> int:
        """SageMaker's older name for pipeline_parallel_degree."""
        return self.pipeline_parallel_degree


KEYS: Tuple[str, ...] = tuple(f.name for f in fields(SMPConfig))

# key -> (type, description of the allowed values). Types: int, bool, float, choice, placement.
_SPEC: Dict[str, Tuple[str, str]] = {
    "pipeline_parallel_degree": ("int", "an int >= 1"),
    "microbatches": ("int", "an int >= 1"),
    "pipeline": ("choice", "one of 'interleaved', 'simple'"),
    "optimize": ("choice", "one of 'speed', 'memory'"),
    "placement_strategy": ("placement", "'cluster', 'spread' or a permutation of D, P, T"),
    "auto_partition": ("bool", "a bool"),
    "default_partition": ("int", "an int in [0, pipeline_parallel_degree)"),
    "memory_weight": ("float", "a number in [0, 1]"),
    "active_microbatches": ("int", "an int in [1, microbatches]"),
    "deterministic_server": ("bool", "a bool"),
    "ddp": ("bool", "a bool"),
    "ddp_port": ("int", "an int in [0, 65535]"),
    "ddp_dist_backend": ("choice", "one of 'auto', 'nccl', 'gloo'"),
    "horovod": ("bool", "a bool"),
    "tensor_parallel_degree": ("int", "an int >= 1"),
    "fp16": ("bool", "a bool"),
    "bf16": ("bool", "a bool"),
    "shard_optimizer_state": ("bool", "a bool"),
    "offload_activations": ("bool", "a bool"),
    "activation_loading_horizon": ("int", "an int >= 1"),
    "prescaled_batch": ("bool", "a bool"),
    "delayed_parameter_initialization": ("bool", "a bool"),
    "skip_tracing": ("bool", "a bool"),
    "sharded_data_parallel_degree": ("int", "an int >= 1"),
    "tensor_parallel_seed": ("int", "an int >= 0"),
    "contiguous": ("bool", "a bool"),
    "fp16_params": ("bool", "a bool"),
    "fast_mode": ("bool", "a bool"),
    "static_mode": ("bool", "a bool"),
    "sdp_reduce_bucket_size": ("count", "an int >= 1 (e.g. 5e8)"),
    "sdp_param_persistence_threshold": ("count", "an int >= 0 (e.g. 1e6)"),
    "sdp_max_live_parameters": ("count", "an int >= 1 (e.g. 1e9)"),
    "sdp_hierarchical_allgather": ("bool", "a bool"),
    "sdp_gradient_clipping": ("float", "a number >= 0"),
}
_CHOICES = {"pipeline": PIPELINES, "optimize": OPTIMIZE, "ddp_dist_backend": DDP_BACKENDS}
_NONE_MEANS_DEFAULT = ("memory_weight", "active_microbatches", "ddp_port")

# Adv keys rejected when not at their default: key -> what it would need.
_UNSUPPORTED = {
    "horovod": "Horovod as the data-parallel engine (use \"ddp\": True)",
}

# Knobs of SageMaker's own engine that only tune its speed or memory: accepted, validated, and
# logged once per process as having no effect here (see the module docstring).
NO_EFFECT: Tuple[str, ...] = (
    "fast_mode", "static_mode", "skip_tracing", "offload_activations",
    "activation_loading_horizon", "delayed_parameter_initialization", "sdp_reduce_bucket_size",
    "sdp_param_persistence_threshold", "sdp_max_live_parameters", "sdp_hierarchical_allgather",
)
# Which (key, value) pairs this process has logged already: smp.init may run several times
# (smp.reset, tests), and the message says nothing new the second time.
_logged_no_effect: Set[Tuple[str, Any]] = set()
assert set(_SPEC) == set(KEYS), "every SMPConfig field needs a validation entry"


def _where(source: str) -> str:
    return f" (from {source})" if source else ""


def _fail(key: str, value: Any, allowed: str, source: str = "") -> SMPConfigError:
    return SMPConfigError(
        f"smp config: {key!r}={value!r}{_where(source)} is invalid: it must be {allowed}"
    )


def _parse_env(env: Mapping[str, str]) -> Dict[str, Any]:
    raw = env.get(ENV_VAR)
    if raw is None or raw.strip() == "":
        return {}
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as e:
        raise SMPConfigError(
            f"smp config: {ENV_VAR}={raw!r} is not valid JSON ({e}); it must be a JSON object "
            "of configuration keys"
        ) from None
    if not isinstance(parsed, dict):
        raise SMPConfigError(
            f"smp config: {ENV_VAR}={raw!r} must be a JSON object of configuration keys"
        )
    return parsed


def _check_type(key: str, value: Any, source: str) -> Any:
    """The value converted to the key's Python type, or SMPConfigError."""
    kind, allowed = _SPEC[ALIASES.get(key, key)]
    if value is None and key in _NONE_MEANS_DEFAULT:
        return None
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise _fail(key, value, f"{allowed} (got a {type(value).__name__})", source)
        return int(value)
    if kind == "bool":
        if not isinstance(value, bool):
            raise _fail(key, value, f"{allowed}, true or false (got a {type(value).__name__})",
                        source)
        return value
    if kind == "count":
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or (
                not isinstance(value, numbers.Integral) and not float(value).is_integer()):
            raise _fail(key, value, f"{allowed} (got a {type(value).__name__})", source)
        return int(value)
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise _fail(key, value, f"{allowed} (got a {type(value).__name__})", source)
        return float(value)
    if kind == "choice":
        if not isinstance(value, str) or value not in _CHOICES[key]:
            raise _fail(key, value, allowed, source)
        return value
    if kind == "placement":
        if isinstance(value, str):
            if value.lower() in PLACEMENT_WORDS:
                return value.lower()
            if sorted(value.upper()) == ["D", "P", "T"]:
                return value.upper()
        raise _fail(key, value, allowed, source)
    raise AssertionError(kind)


def _normalise(raw: Any, source: str) -> Dict[str, Tuple[Any, str]]:
    """One source's keys with the alias folded in: key -> (value, source)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise SMPConfigError(
            f"smp config{_where(source)} must be a dict of configuration keys, "
            f"got a {type(raw).__name__}"
        )
    out: Dict[str, Tuple[Any, str]] = {}
    for key, value in raw.items():
        if not isinstance(key, str):
            raise SMPConfigError(f"smp config{_where(source)}: key {key!r} is not a string")
        out[key] = (value, source)
    for alias, canonical in ALIASES.items():
        if alias not in out:
            continue
        a = _check_type(alias, out[alias][0], source)
        if canonical in out:
            c = _check_type(canonical, out[canonical][0], source)
            if a != c:
                raise SMPConfigError(
                    f"smp config{_where(source)}: conflicting values {alias!r}={a!r} and "
                    f"{canonical!r}={c!r} ({alias!r} is an alias of {canonical!r}); "
                    "give one of them"
                )
        out[canonical] = (out.pop(alias)[0], source)
    return out


def _merge(user: Optional[Mapping[str, Any]], env: Mapping[str, str]) -> Dict[str, Tuple[Any, str]]:
    merged = _normalise(user, "smp.init config")
    for key, (value, source) in _normalise(_parse_env(env), ENV_VAR).items():
        if key in merged and merged[key][0] != value:
            logger.info("smp config: %s=%r from %s overrides %r from the smp.init config",
                        key, value, ENV_VAR, merged[key][0])
        merged[key] = (value, source)
    return merged


def _unknown(merged: Mapping[str, Tuple[Any, str]]) -> None:
    unknown = sorted(k for k in merged if k not in _SPEC)
    if not unknown:
        return
    parts = []
    for key in unknown:
        value, source = merged[key]
        hint = difflib.get_close_matches(key, list(KEYS) + list(ALIASES), n=1)
        parts.append(f"{key!r}={value!r}{_where(source)}"
                     + (f" (did you mean {hint[0]!r}?)" if hint else ""))
    raise SMPConfigError(
        f"smp config: unknown key{'s' if len(parts) > 1 else ''} {', '.join(parts)}. "
        f"Allowed keys: {', '.join(KEYS)} (and the alias 'partitions')"
    )


def _check_ranges(v: Dict[str, Any], src: Dict[str, str]) -> None:
    def at_least(key: str, low: int) -> None:
        if v[key] < low:
            raise _fail(key, v[key], _SPEC[key][1], src.get(key, ""))

    for key in ("pipeline_parallel_degree", "microbatches", "tensor_parallel_degree",
                "sharded_data_parallel_degree", "activation_loading_horizon"):
        at_least(key, 1)
    at_least("tensor_parallel_seed", 0)
    for key in ("sdp_reduce_bucket_size", "sdp_max_live_parameters"):
        at_least(key, 1)
    at_least("sdp_param_persistence_threshold", 0)
    if v["sdp_gradient_clipping"] < 0:
        raise _fail("sdp_gradient_clipping", v["sdp_gradient_clipping"],
                    _SPEC["sdp_gradient_clipping"][1], src.get("sdp_gradient_clipping", ""))
    pp = v["pipeline_parallel_degree"]
    if not 0 <= v["default_partition"] < pp:
        raise _fail("default_partition", v["default_partition"],
                    f"an int in [0, pipeline_parallel_degree={pp})",
                    src.get("default_partition", ""))
    mw = v["memory_weight"]
    if mw is not None and not 0.0 <= mw <= 1.0:
        raise _fail("memory_weight", mw, _SPEC["memory_weight"][1], src.get("memory_weight", ""))
    am, mb = v["active_microbatches"], v["microbatches"]
    if am is not None and not 1 <= am <= mb:
        raise _fail("active_microbatches", am, f"an int in [1, microbatches={mb}]",
                    src.get("active_microbatches", ""))
    port = v["ddp_port"]
    if port is not None and not 0 <= port <= 65535:
        raise _fail("ddp_port", port, _SPEC["ddp_port"][1], src.get("ddp_port", ""))


def _check_mixed_precision_and_sharding(v: Dict[str, Any], src: Dict[str, str]) -> None:
    """fp16/bf16 pick one reduced dtype for the whole model, so both at once is ambiguous;
    fp16_params only says the parameters are created in fp16, which needs fp16 on; sharding
    optimizer state splits it over data-parallel replicas, which only exist with ddp."""
    if v["fp16"] and v["bf16"]:
        raise SMPConfigError(
            f"smp config: 'fp16'=True{_where(src.get('fp16', ''))} and "
            f"'bf16'=True{_where(src.get('bf16', ''))} cannot both be set: the model runs in one "
            "reduced precision; set one of them to false")
    if v["fp16_params"] and not v["fp16"]:
        raise SMPConfigError(
            f"smp config: 'fp16_params'=True{_where(src.get('fp16_params', ''))} needs "
            "'fp16'=True (it creates the parameters in fp16); set \"fp16\": true or remove "
            "'fp16_params'")
    if v["shard_optimizer_state"] and not v["ddp"]:
        raise SMPConfigError(
            f"smp config: 'shard_optimizer_state'=True{_where(src.get('shard_optimizer_state', ''))}"
            " needs 'ddp'=True (the optimizer state is split over the data-parallel replicas); "
            "set \"ddp\": true or remove 'shard_optimizer_state'")


def _log_no_effect(given: Mapping[str, Any], src: Mapping[str, str]) -> None:
    """One INFO line naming the speed/memory knobs given that change nothing here."""
    new = [(k, given[k]) for k in NO_EFFECT if k in given and (k, given[k]) not in _logged_no_effect]
    if not new:
        return
    _logged_no_effect.update(new)
    logger.info(
        "smp config: %s only tune the speed or memory of SageMaker's own engine and have no "
        "effect in smshim (accepted and validated; training results are the same)",
        ", ".join(f"{k}={val!r}{_where(src.get(k, ''))}" for k, val in new))


def _master_port(env: Mapping[str, str]) -> Optional[int]:
    raw = env.get("MASTER_PORT")
    try:
        return int(raw) if raw else None
    except ValueError:
        return None


LAUNCH_HINT = ("`smshim run -n {n} --distribution '...' script.py`, `torchrun --nproc-per-node {n} "
               "script.py` or `mpirun -n {n} python script.py`")


def _provenance(user: Optional[Mapping[str, Any]], env: Mapping[str, str]) -> str:
    """Where this config came from, for the errors that concern the whole config."""
    found = []
    if user:
        found.append("smp.init's argument")
    if (env.get(ENV_VAR) or "").strip():
        found.append(ENV_VAR)
    if not found:
        return (f"no smp config found (looked in smp.init's argument and {ENV_VAR}), so every "
                "key has its default")
    return "config from " + " and ".join(found)


def _check_world_size(v: Dict[str, Any], world_size: Any, provenance: str,
                      launcher: Optional[str]) -> None:
    pp, tp = v["pipeline_parallel_degree"], v["tensor_parallel_degree"]
    if not isinstance(world_size, int) or world_size < 1:
        raise SMPConfigError(f"smp config: world size {world_size!r} must be an int >= 1")
    give = (f"give the config: launch with `smshim run --distribution '{{...}}'` (a SageMaker "
            f"distribution), set {ENV_VAR}='{{\"partitions\": 2, \"ddp\": true}}' or pass "
            "a dict to smp.init")
    if launcher == "single" and world_size == 1 and pp * tp > 1:
        raise SMPConfigError(
            f"smp config: this process was started without a launcher (no torchrun, MPI or "
            f"SageMaker variables), so the world size is 1, not divisible by "
            f"pipeline_parallel_degree {pp} x tensor_parallel_degree {tp} = {pp * tp} "
            f"({provenance}); launch {pp * tp} processes with " + LAUNCH_HINT.format(n=pp * tp))
    if world_size % (pp * tp) != 0:
        raise SMPConfigError(
            f"smp config: world size {world_size} is not divisible by pipeline_parallel_degree "
            f"{pp} x tensor_parallel_degree {tp} = {pp * tp} ({provenance}); launch a multiple "
            f"of {pp * tp} processes or change 'pipeline_parallel_degree'"
            + ("; " + give if provenance.startswith("no smp config") else "")
        )
    if world_size > pp * tp and not v["ddp"]:
        raise SMPConfigError(
            f"smp config: world size {world_size} > pipeline_parallel_degree {pp} x "
            f"tensor_parallel_degree {tp} = {pp * tp} needs data parallelism: set \"ddp\": true "
            f"(or launch {pp * tp} processes) ({provenance})"
            + ("; " + give if provenance.startswith("no smp config") else "")
        )


def resolve_config(user: Optional[Mapping[str, Any]] = None, world_size: int = 1,
                   env: Mapping[str, str] = os.environ, launcher: Optional[str] = None) -> SMPConfig:
    """Merge `user` with SM_HP_MP_PARAMETERS from `env` (env wins), validate, fill defaults.

    Raises SMPConfigError (a ValueError) for an invalid configuration and SMPUnsupportedError
    (a NotImplementedError) for an Adv feature smshim does not implement. Errors about the whole
    config say where it came from (or that none was found); `launcher` ("single": no launcher
    detected) lets a one-process start say that a launcher is missing.
    """
    merged = _merge(user, env)
    _unknown(merged)
    src = {k: s for k, (_, s) in merged.items()}
    given = {k: _check_type(k, val, s) for k, (val, s) in merged.items()}
    defaults = SMPConfig()
    v: Dict[str, Any] = {k: getattr(defaults, k) for k in KEYS}
    v["memory_weight"] = v["active_microbatches"] = v["ddp_port"] = None  # derived below
    v.update(given)
    explicit = {k for k, val in given.items() if val is not None}
    _check_ranges(v, src)

    # Dependencies.
    if not v["auto_partition"] and "default_partition" not in explicit:
        raise SMPConfigError(
            "smp config: 'auto_partition'=False needs 'default_partition' (an int in "
            f"[0, pipeline_parallel_degree={v['pipeline_parallel_degree']})): the partition of "
            "modules created outside `with smp.partition(i)`. Add it, e.g. \"default_partition\": 0"
        )
    for key in ("ddp_port", "ddp_dist_backend"):
        if key in explicit and not v["ddp"]:
            raise SMPConfigError(
                f"smp config: {key!r}={v[key]!r}{_where(src[key])} needs 'ddp'=True; "
                f"set \"ddp\": true or remove {key!r}"
            )
    if v["horovod"] and v["ddp"]:
        raise SMPConfigError(
            "smp config: 'horovod'=True cannot be combined with 'ddp'=True; choose one "
            "(smshim supports 'ddp')"
        )
    _check_mixed_precision_and_sharding(v, src)
    if v["memory_weight"] is None:
        v["memory_weight"] = MEMORY_WEIGHT[v["optimize"]]
    if v["pipeline"] == "simple":
        if v["active_microbatches"] is None:
            v["active_microbatches"] = v["microbatches"]
        elif v["active_microbatches"] != v["microbatches"]:
            logger.warning(
                "smp config: pipeline 'simple' needs active_microbatches == microbatches, but "
                "active_microbatches=%d and microbatches=%d; using pipeline 'interleaved'",
                v["active_microbatches"], v["microbatches"])
            v["pipeline"] = "interleaved"
    if v["active_microbatches"] is None:
        v["active_microbatches"] = min(v["pipeline_parallel_degree"] + 2, v["microbatches"])
    if v["ddp_port"] is None:
        v["ddp_port"] = _master_port(env)

    # Adv features smshim does not implement.
    for key, what in _UNSUPPORTED.items():
        if v[key] != getattr(defaults, key):
            raise SMPUnsupportedError(
                f"smp config: {key!r}={v[key]!r}{_where(src.get(key, ''))} is not supported by "
                f"smshim ({what} is not implemented); remove {key!r} or set it to "
                f"{getattr(defaults, key)!r}"
            )

    _log_no_effect(given, src)

    _check_world_size(v, world_size, _provenance(user, env), launcher)
    _check_sharded_data_parallel(v, src, world_size)
    return SMPConfig(**v)


def _check_sharded_data_parallel(v: Dict[str, Any], src: Dict[str, str], world_size: int) -> None:
    """sharded_data_parallel_degree k > 1 (FSDP, sharded_data_parallel/fsdp.py): the data-parallel
    ranks form replicas of k shards, so it needs ddp and a world of k x replicas; SMP v1 runs it
    without pipeline parallelism and instead of shard_optimizer_state. Not implemented here yet:
    with tensor parallelism."""
    k = v["sharded_data_parallel_degree"]
    if k == 1:
        return
    where = _where(src.get("sharded_data_parallel_degree", ""))
    head = f"smp config: 'sharded_data_parallel_degree'={k}{where}"
    if not v["ddp"]:
        raise SMPConfigError(f"{head} needs 'ddp'=True (the sharded ranks are data-parallel "
                             "ranks); set \"ddp\": true")
    for key, bad, why in (
            ("pipeline_parallel_degree", v["pipeline_parallel_degree"] > 1,
             "sharded data parallelism runs without pipeline parallelism; set "
             "'pipeline_parallel_degree' to 1 or 'sharded_data_parallel_degree' to 1"),
            ("shard_optimizer_state", v["shard_optimizer_state"],
             "sharded data parallelism already shards the optimizer state; remove "
             "'shard_optimizer_state'")):
        if bad:
            raise SMPConfigError(f"{head} cannot be combined with {key!r}={v[key]!r}"
                                 f"{_where(src.get(key, ''))}: {why}")
    for key, bad in (("tensor_parallel_degree", v["tensor_parallel_degree"] > 1),):
        if bad:
            raise SMPUnsupportedError(
                f"{head} with {key!r}={v[key]!r}{_where(src.get(key, ''))} is not supported by "
                f"smshim yet; remove {key!r} or set 'sharded_data_parallel_degree' to 1")
    if world_size % k != 0:
        raise SMPConfigError(
            f"{head}: the world size {world_size} is not a multiple of it (the ranks form "
            f"replicas of {k} shards); launch a multiple of {k} processes or change "
            "'sharded_data_parallel_degree'")
