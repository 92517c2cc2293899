"""A SageMaker estimator's `distribution` and `hyperparameters`, turned into what its container sets.

`parse_distribution` validates the dict (every error names the field), `job_environment` builds
the environment variables and `hyperparameter_args` the `--name value` arguments the SageMaker
training toolkit would give the entry point. The launcher (smshim/cli.py) applies them.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional


class DistributionError(ValueError):
    """A malformed SageMaker `distribution`; the message names the field."""


@dataclass
class Distribution:
    modelparallel: bool = False
    dataparallel: bool = False
    mp_parameters: Dict[str, Any] = field(default_factory=dict)
    mpi_enabled: bool = False
    processes_per_host: Optional[int] = None
    custom_mpi_options: str = ""
    # The PyTorch / Hugging Face estimators' torchrun-style launchers (SageMaker starts the
    # script with torchrun for each; smshim always launches that way).
    torch_distributed: bool = False
    pytorchddp: bool = False
    pytorchxla: bool = False

    @property
    def smp_v2(self) -> bool:
        """`torch_distributed` + `smdistributed.modelparallel` is an SMP v2 (torch.sagemaker) job."""
        return self.modelparallel and self.torch_distributed


def _expect(value: Any, kind: type, where: str) -> Any:
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise DistributionError(
            f"distribution field {where} must be {kind.__name__}, got {value!r}"
        )
    return value


def _check_keys(d: Mapping[str, Any], allowed: set, where: str) -> None:
    for key in d:
        if key not in allowed:
            raise DistributionError(
                f"unknown distribution field {where}.{key}; allowed here: {sorted(allowed)}"
            )


def load_json_arg(raw: str, option: str) -> Any:
    """An option's value given as JSON, a Python literal (as pasted from a notebook: True,
    single quotes) or `@path` to a JSON file."""
    text = raw
    if raw.startswith("@"):
        path = raw[1:]
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise DistributionError(f"{option} {raw}: cannot read {path!r} ({e.strerror})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        json_error = e
    try:
        return ast.literal_eval(text.strip())
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    raise DistributionError(
        f"{option} is not valid JSON ({json_error}) nor a Python dict literal; give JSON "
        f"({option} '{{\"mpi\": {{\"enabled\": true}}}}'), the dict as written in Python "
        f"(True/False and single quotes are fine) or @path/to/file.json"
    )


_LAUNCHERS = ("torch_distributed", "pytorchddp", "pytorchxla")


def _enabled_flag(raw: Mapping[str, Any], name: str) -> bool:
    sub = _expect(raw[name], dict, name)
    _check_keys(sub, {"enabled"}, name)
    return _expect(sub.get("enabled", False), bool, f"{name}.enabled")


def parse_distribution(raw: Any) -> Distribution:
    """Validate a distribution given as JSON text, a Python literal, `@file.json` or a dict."""
    if isinstance(raw, str):
        raw = load_json_arg(raw, "--distribution")
    _expect(raw, dict, "<top level>")
    _check_keys(raw, {"smdistributed", "mpi", *_LAUNCHERS}, "distribution")
    out = Distribution()
    for name in _LAUNCHERS:
        if name in raw:
            setattr(out, name, _enabled_flag(raw, name))
    smd = raw.get("smdistributed", {})
    _expect(smd, dict, "smdistributed")
    _check_keys(smd, {"modelparallel", "dataparallel"}, "smdistributed")
    for lib in ("modelparallel", "dataparallel"):
        if lib not in smd:
            continue
        sub = _expect(smd[lib], dict, f"smdistributed.{lib}")
        allowed = {"enabled", "parameters"} if lib == "modelparallel" else {"enabled", "custom_mpi_options"}
        _check_keys(sub, allowed, f"smdistributed.{lib}")
        enabled = _expect(sub.get("enabled", False), bool, f"smdistributed.{lib}.enabled")
        setattr(out, lib, enabled)
        if lib == "modelparallel":
            out.mp_parameters = dict(_expect(sub.get("parameters", {}), dict,
                                             "smdistributed.modelparallel.parameters"))
    if out.modelparallel and out.dataparallel:
        raise DistributionError(
            "smdistributed.modelparallel and smdistributed.dataparallel are both enabled; "
            "enable one (model parallelism has its own data parallelism: parameters.ddp=true)"
        )
    mpi = _expect(raw.get("mpi", {}), dict, "mpi")
    _check_keys(mpi, {"enabled", "processes_per_host", "custom_mpi_options"}, "mpi")
    out.mpi_enabled = _expect(mpi.get("enabled", False), bool, "mpi.enabled")
    if "processes_per_host" in mpi:
        pph = _expect(mpi["processes_per_host"], int, "mpi.processes_per_host")
        if pph < 1:
            raise DistributionError(f"distribution field mpi.processes_per_host must be >= 1, got {pph}")
        out.processes_per_host = pph
    out.custom_mpi_options = _expect(mpi.get("custom_mpi_options", ""), str, "mpi.custom_mpi_options")
    _check_launchers(out)
    return out


def _check_launchers(out: Distribution) -> None:
    """The combinations the SageMaker SDK accepts (one launcher; smp v1 under MPI, v2 under
    torch_distributed)."""
    chosen = [n for n in _LAUNCHERS if getattr(out, n)] + (["mpi"] if out.mpi_enabled else [])
    if len(chosen) > 1:
        raise DistributionError(
            f"distribution enables {' and '.join(chosen)}: each is a launcher, enable one "
            "(torch_distributed for torchrun, mpi for smdistributed v1)")
    if out.pytorchddp and (out.modelparallel or out.dataparallel):
        raise DistributionError(
            "pytorchddp is native PyTorch DDP and cannot be combined with smdistributed; use "
            '{"torch_distributed": {"enabled": true}, "smdistributed": {...}} or drop smdistributed')
    if out.pytorchxla and (out.modelparallel or out.dataparallel):
        raise DistributionError("pytorchxla (the Training Compiler launcher) cannot be combined "
                                "with smdistributed; enable one")
    if out.modelparallel and not out.mpi_enabled and not out.torch_distributed:
        raise DistributionError(
            "smdistributed.modelparallel needs a launcher: mpi.enabled=true for SMP v1 "
            '(add "mpi": {"enabled": true, "processes_per_host": N}) or '
            'torch_distributed.enabled=true for SMP v2 (add "torch_distributed": {"enabled": true})'
        )
    if out.modelparallel and out.mpi_enabled and out.processes_per_host is None:
        raise DistributionError(
            "smdistributed.modelparallel needs mpi.processes_per_host (processes per host)"
        )


def check_launcher_available(dist: Distribution) -> None:
    """What the chosen launcher needs installed (pytorchxla: torch_xla)."""
    if dist.pytorchxla and importlib.util.find_spec("torch_xla") is None:
        raise DistributionError(
            "distribution pytorchxla (SageMaker Training Compiler) needs torch_xla, which is not "
            "installed; install torch_xla, or launch the same script with torchrun semantics "
            'without XLA: --distribution \'{"torch_distributed": {"enabled": true}}\' '
            "(or pytorchddp)")


def container_hyperparameters(dist: Distribution, hps: Mapping[str, Any]) -> Dict[str, Any]:
    """The user's hyperparameters plus `mp_parameters`, which the SageMaker SDK adds for model
    parallelism: it reaches the script as SM_HP_MP_PARAMETERS and as `--mp_parameters k=v,...`."""
    out = dict(hps)
    if dist.smp_v2:
        # The SDK's v2 path (SMP._to_mp_hyperparameters) sends the dict as a JSON string.
        out["mp_parameters"] = json.dumps(dist.mp_parameters)
    elif dist.modelparallel:
        out["mp_parameters"] = dict(dist.mp_parameters)
    return out


def _hp_value(value: Any) -> str:
    """The toolkit passes strings as they are and everything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def hyperparameter_args(hps: Mapping[str, Any]) -> List[str]:
    """`--name value` pairs, sorted by name, as the SageMaker toolkit passes them (a dict value
    becomes `k=v,k=v`)."""
    args: List[str] = []
    for name in sorted(hps):
        value = hps[name]
        if isinstance(value, dict):
            text = ",".join(f"{k}={v}" for k, v in sorted(value.items()))
        else:
            text = value if isinstance(value, str) else str(value)
        args += [f"--{name}" if len(name) > 1 else f"-{name}", text]
    return args


def job_environment(
    dist: Distribution,
    hps: Mapping[str, Any],
    *,
    nproc_per_node: int,
    nnodes: int,
    node_rank: int,
    model_dir: str,
    output_data_dir: str,
    channels: Mapping[str, str],
    num_gpus: int,
    num_cpus: int,
) -> Dict[str, str]:
    """The variables a SageMaker training container sets for this job on node `node_rank`.
    `hps` are the container's hyperparameters (see `container_hyperparameters`)."""
    hosts = [f"algo-{i + 1}" for i in range(nnodes)]
    env = {
        "SM_HOSTS": json.dumps(hosts),
        "SM_CURRENT_HOST": hosts[node_rank],
        "SM_NUM_GPUS": str(num_gpus),
        "SM_NUM_CPUS": str(num_cpus),
        "SM_MODEL_DIR": model_dir,
        "SM_OUTPUT_DATA_DIR": output_data_dir,
        "SM_HPS": json.dumps(dict(hps)),
        "SM_FRAMEWORK_PARAMS": json.dumps({
            "sagemaker_mpi_enabled": dist.mpi_enabled,
            "sagemaker_mpi_num_of_processes_per_host": nproc_per_node,
            "sagemaker_mpi_custom_mpi_options": dist.custom_mpi_options,
            "sagemaker_distributed_dataparallel_enabled": dist.dataparallel,
            "sagemaker_torch_distributed_enabled": dist.torch_distributed,
            "sagemaker_pytorch_ddp_enabled": dist.pytorchddp,
            "sagemaker_pytorch_xla_multi_worker_enabled": dist.pytorchxla,
        }),
        "SM_CHANNELS": json.dumps(sorted(channels)),
    }
    for name, value in hps.items():
        env["SM_HP_" + name.upper().replace("-", "_")] = _hp_value(value)
    for name, path in channels.items():
        env["SM_CHANNEL_" + name.upper().replace("-", "_")] = os.path.abspath(path)
    return env
