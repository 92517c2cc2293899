"""A SageMaker estimator's `distribution` and `hyperparameters`, turned into what its container sets.

`parse_distribution` validates the dict (every error names the field), `job_environment` builds
the environment variables and `hyperparameter_args` the `--name value` arguments the SageMaker
training toolkit would give the entry point. The launcher (smshim/cli.py) applies them.
"""

from __future__ import annotations

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


def parse_distribution(raw: Any) -> Distribution:
    """Validate a distribution given as JSON text or a dict."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as e:
            raise DistributionError(f"--distribution is not valid JSON: {e}") from None
    _expect(raw, dict, "<top level>")
    _check_keys(raw, {"smdistributed", "mpi"}, "distribution")
    out = Distribution()
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
    if out.modelparallel and not out.mpi_enabled:
        raise DistributionError(
            "smdistributed.modelparallel needs mpi.enabled=true (SageMaker launches it with MPI); "
            'add "mpi": {"enabled": true, "processes_per_host": N}'
        )
    if out.modelparallel and out.processes_per_host is None:
        raise DistributionError(
            "smdistributed.modelparallel needs mpi.processes_per_host (processes per host)"
        )
    return out


def container_hyperparameters(dist: Distribution, hps: Mapping[str, Any]) -> Dict[str, Any]:
    """The user's hyperparameters plus `mp_parameters`, which the SageMaker SDK adds for model
    parallelism: it reaches the script as SM_HP_MP_PARAMETERS and as `--mp_parameters k=v,...`."""
    out = dict(hps)
    if dist.modelparallel:
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
        }),
        "SM_CHANNELS": json.dumps(sorted(channels)),
    }
    for name, value in hps.items():
        env["SM_HP_" + name.upper().replace("-", "_")] = _hp_value(value)
    for name, path in channels.items():
        env["SM_CHANNEL_" + name.upper().replace("-", "_")] = os.path.abspath(path)
    return env
