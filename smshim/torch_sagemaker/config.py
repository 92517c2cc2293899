"""SMP v2 configuration: the documented keys, where they come from, and their validation.

Sources, lowest precedence first: the `config` passed to `tsm.init` (a dict or a JSON file path),
then the job's `SM_HP_MP_PARAMETERS` (SageMaker's `mp_parameters` hyperparameter, a JSON object):
job values override the script's, as on SageMaker. Unknown keys are kept out of the config and
logged as a warning (SageMaker's SDK itself sends v1 keys such as `placement_strategy`).

Validation depends only on the config and the world size, so every rank raises the same error
before any collective is entered; each message names the key and its value.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, fields
from typing import Any, Dict, Mapping, Optional, Union

logger = logging.getLogger(__name__)

ENV_VAR = "SM_HP_MP_PARAMETERS"


@dataclass
class TsmConfig:
    hybrid_shard_degree: int = 0
    tensor_parallel_degree: int = 1
    context_parallel_degree: int = 1
    expert_parallel_degree: int = 1
    sm_activation_offloading: bool = True
    activation_loading_horizon: int = 2
    fsdp_cache_flush_warnings: bool = True
    allow_empty_shards: bool = False
    random_seed: int = 12345


_INT_KEYS = ("hybrid_shard_degree", "tensor_parallel_degree", "context_parallel_degree",
             "expert_parallel_degree", "activation_loading_horizon", "random_seed")
_BOOL_KEYS = ("sm_activation_offloading", "fsdp_cache_flush_warnings", "allow_empty_shards")
KNOWN_KEYS = frozenset(f.name for f in fields(TsmConfig))


class TsmConfigError(ValueError):
    """A configuration value SMP v2 cannot run with; the message names the key."""


def _read_argument(config: Union[None, str, os.PathLike, Mapping[str, Any]]) -> Dict[str, Any]:
    if config is None:
        return {}
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                data = json.load(f)
        except OSError as e:
            raise TsmConfigError(f"tsm.init: cannot read the config file {str(config)!r}: {e}") from None
        except json.JSONDecodeError as e:
            raise TsmConfigError(f"tsm.init: config file {str(config)!r} is not JSON: {e}") from None
    elif isinstance(config, Mapping):
        data = dict(config)
    else:
        raise TsmConfigError(f"tsm.init(config=...) takes None, a dict or a JSON file path, "
                             f"not {type(config).__name__}")
    if not isinstance(data, dict):
        raise TsmConfigError(f"tsm.init: the config must be a JSON object, got {type(data).__name__}")
    return data


def _read_job(env: Mapping[str, str]) -> Dict[str, Any]:
    raw = env.get(ENV_VAR)
    if not raw:
        return {}
    try:
        data = json.loads(raw)
    except json.JSONDecodeError as e:
        raise TsmConfigError(f"{ENV_VAR}={raw!r} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise TsmConfigError(f"{ENV_VAR} must be a JSON object, got {raw!r}")
    return data


def _coerce(key: str, value: Any) -> Any:
    if key in _BOOL_KEYS:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise TsmConfigError(f"SMP config key {key!r} must be a bool, got {value!r}")
    if key in _INT_KEYS:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, str) and value.strip().lstrip("-").isdigit():
                return int(value)
            raise TsmConfigError(f"SMP config key {key!r} must be an integer, got {value!r}")
        return value
    return value


def load_config(config: Union[None, str, os.PathLike, Mapping[str, Any]] = None,
                env: Optional[Mapping[str, str]] = None) -> TsmConfig:
    """Merge the argument and the job's values (job wins), drop unknown keys with a warning."""
    env = os.environ if env is None else env
    merged = _read_argument(config)
    job = _read_job(env)
    overridden = sorted(k for k in job if k in merged and merged[k] != job[k])
    if overridden:
        logger.info("SMP config: the job's %s overrides tsm.init's value for %s", ENV_VAR, overridden)
    merged.update(job)
    unknown = sorted(k for k in merged if k not in KNOWN_KEYS)
    if unknown:
        logger.warning("SMP config: ignoring unknown key(s) %s (known: %s)", unknown, sorted(KNOWN_KEYS))
    return TsmConfig(**{k: _coerce(k, v) for k, v in merged.items() if k in KNOWN_KEYS})


@dataclass(frozen=True)
class Degrees:
    """The job's layout: world = mp × shard × replicas with mp = tp·ep; cp lies inside shard."""

    world_size: int
    tp: int
    cp: int
    ep: int
    shard: int  # the FSDP sharding-group size actually used (hybrid_shard_degree 0 resolved)
    replicas: int

    @property
    def mp(self) -> int:
        return self.tp * self.ep


def resolve_degrees(cfg: TsmConfig, world_size: int) -> Degrees:
    """Check the degrees against the world size; resolve hybrid_shard_degree 0 (the largest)."""
    tp, cp, ep, hsd = (cfg.tensor_parallel_degree, cfg.context_parallel_degree,
                       cfg.expert_parallel_degree, cfg.hybrid_shard_degree)
    for key, v in (("tensor_parallel_degree", tp), ("context_parallel_degree", cp),
                   ("expert_parallel_degree", ep)):
        if not 1 <= v <= world_size:
            raise TsmConfigError(f"SMP config key {key!r}={v} must be in 1..world_size ({world_size})")
    if not 0 <= hsd <= world_size:
        raise TsmConfigError(f"SMP config key 'hybrid_shard_degree'={hsd} must be in "
                             f"0..world_size ({world_size})")
    if cfg.activation_loading_horizon < 1:
        raise TsmConfigError("SMP config key 'activation_loading_horizon'="
                             f"{cfg.activation_loading_horizon} must be >= 1")
    if tp > 1 and ep > 1:
        raise TsmConfigError(f"SMP config: 'tensor_parallel_degree'={tp} and 'expert_parallel_degree'"
                             f"={ep} cannot both be > 1 (expert parallelism does not combine with TP)")
    mp = tp * ep
    mp_key = "tensor_parallel_degree" if tp > 1 else "expert_parallel_degree"
    if world_size % mp:
        raise TsmConfigError(f"SMP config key {mp_key!r}={mp} does not divide the world size "
                             f"{world_size}")
    per_mp = world_size // mp
    shard = per_mp if hsd == 0 else hsd
    if shard > per_mp or per_mp % shard:
        raise TsmConfigError(
            f"SMP config key 'hybrid_shard_degree'={hsd}: world size {world_size} = {mp_key}({mp}) x "
            f"hybrid_shard_degree x replicas has no solution; use a divisor of {per_mp}")
    if cp > 1 and (shard < cp or shard % cp):
        raise TsmConfigError(
            f"SMP config key 'context_parallel_degree'={cp} must divide hybrid_shard_degree "
            f"({shard if hsd == 0 else hsd}{' resolved from 0' if hsd == 0 else ''}): context-parallel "
            "ranks lie inside the sharding group")
    return Degrees(world_size, tp, cp, ep, shard, per_mp // shard)
