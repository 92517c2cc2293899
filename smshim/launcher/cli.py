"""`smshim run`: launch a training script on N processes per node, torchrun-style.

Built on torchrun's launcher API (`torch.distributed.launcher.api`): the elastic agent starts,
watches and tears down the workers. On top of it, `--distribution` / `--hyperparameters` take a
SageMaker estimator's arguments and set what the SageMaker container would, so a SageMaker job
definition runs unchanged on a laptop or a cluster.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import uuid
from typing import Dict, List, NoReturn, Optional, Sequence

from smshim.timeline import plot as timeline_plot
from smshim.launcher.sagemaker_env import (
    Distribution,
    DistributionError,
    container_hyperparameters,
    hyperparameter_args,
    job_environment,
    parse_distribution,
)

logger = logging.getLogger("smshim.run")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="smshim", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run a training script on several processes")
    r.add_argument("-n", "--nproc-per-node", "--nproc_per_node", type=int, default=None,
                   help="processes per node (default: mpi.processes_per_host, else GPUs, else 1)")
    r.add_argument("--nnodes", type=int, default=1)
    r.add_argument("--node-rank", "--node_rank", type=int, default=0)
    r.add_argument("--master-addr", "--master_addr", default=None,
                   help="address of node 0 (needed with --nnodes > 1)")
    r.add_argument("--master-port", "--master_port", type=int, default=None)
    r.add_argument("--distribution", default=None,
                   help="a SageMaker estimator's distribution, as JSON")
    r.add_argument("--hyperparameters", default=None,
                   help="a SageMaker estimator's hyperparameters, as a JSON object")
    r.add_argument("--channel", action="append", default=[], metavar="NAME=PATH",
                   help="a data channel: sets SM_CHANNEL_<NAME> (repeatable)")
    r.add_argument("--max-restarts", "--max_restarts", type=int, default=0,
                   help="restart the whole worker group up to N times after a worker fails "
                        "(torchrun's meaning); scripts resume from their newest checkpoint")
    r.add_argument("--output-dir", default="smshim_output",
                   help="where SM_MODEL_DIR (model/) and SM_OUTPUT_DATA_DIR (output/data/) point")
    r.add_argument("script", help="the training script")
    r.add_argument("script_args", nargs=argparse.REMAINDER)
    t = sub.add_parser("timeline", help="draw a pipeline timeline (SMSHIM_TRACE=DIR) as a PNG")
    timeline_plot.add_arguments(t)
    return p


def _fail(msg: str) -> NoReturn:
    print(f"smshim run: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _nproc(requested: Optional[int], dist: Distribution) -> int:
    if requested is not None:
        if requested < 1:
            _fail(f"--nproc-per-node must be >= 1, got {requested}")
        if dist.processes_per_host is not None and dist.processes_per_host != requested:
            _fail(f"--nproc-per-node {requested} disagrees with the distribution's "
                  f"mpi.processes_per_host {dist.processes_per_host}; give one of them")
        return requested
    if dist.processes_per_host is not None:
        return dist.processes_per_host
    import torch

    return max(torch.cuda.device_count(), 1)


def _channels(specs: Sequence[str]) -> Dict[str, str]:
    out = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            _fail(f"--channel {spec!r}: expected NAME=PATH")
        out[name] = path
    return out


def prepare(a: argparse.Namespace) -> tuple:
    """Validate the `run` arguments and set the job's environment; returns (LaunchConfig, args).

    Everything that can be wrong is found here, before any process starts.
    """
    try:
        dist = parse_distribution(a.distribution) if a.distribution else Distribution()
    except DistributionError as e:
        _fail(str(e))
    hps = {}
    if a.hyperparameters:
        try:
            hps = json.loads(a.hyperparameters)
        except json.JSONDecodeError as e:
            _fail(f"--hyperparameters is not valid JSON: {e}")
        if not isinstance(hps, dict):
            _fail("--hyperparameters must be a JSON object of name: value")
    if a.nnodes < 1 or not (0 <= a.node_rank < a.nnodes):
        _fail(f"--node-rank {a.node_rank} must be in [0, --nnodes {a.nnodes})")
    if a.nnodes > 1 and not a.master_addr:
        _fail("--nnodes > 1 needs --master-addr (the address of node 0) and --master-port")
    if not os.path.exists(a.script):
        _fail(f"script {a.script!r} not found")
    nproc = _nproc(a.nproc_per_node, dist)
    channels = _channels(a.channel)

    import torch
    from torch.distributed.launcher.api import LaunchConfig

    hps = container_hyperparameters(dist, hps)
    if a.distribution or a.hyperparameters or channels:
        model_dir = os.path.abspath(os.path.join(a.output_dir, "model"))
        data_dir = os.path.abspath(os.path.join(a.output_dir, "output", "data"))
        os.makedirs(model_dir, exist_ok=True)
        os.makedirs(data_dir, exist_ok=True)
        os.environ.update(job_environment(
            dist, hps, nproc_per_node=nproc, nnodes=a.nnodes, node_rank=a.node_rank,
            model_dir=model_dir, output_data_dir=data_dir, channels=channels,
            num_gpus=torch.cuda.device_count(), num_cpus=os.cpu_count() or 1,
        ))
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = "1"  # as torchrun does: N processes must not fight for cores

    if a.max_restarts < 0:
        _fail(f"--max-restarts must be >= 0, got {a.max_restarts}")
    if a.nnodes == 1:
        # torchrun --standalone's c10d rendezvous (it re-forms the group after a restart), with
        # its stores and the workers' gloo sockets on loopback only: nothing outside needs them.
        from smshim.launcher import rendezvous as _rendezvous
        from smshim.runtime.launch import loopback_interface

        rdzv = dict(rdzv_backend=_rendezvous.register(),
                    rdzv_endpoint=f"{_rendezvous.LOOPBACK}:{a.master_port or 0}", rdzv_configs={},
                    local_addr=_rendezvous.LOOPBACK)
        ifname = loopback_interface()
        if ifname and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = ifname
    else:
        addr = a.master_addr
        port = a.master_port or 29500
        if a.max_restarts > 0:
            # torchrun's recommendation for restarts: the c10d rendezvous (measured with torch
            # 2.13: the static one's new attempt dialed the old attempt's gloo addresses). The
            # store it shares with the workers outlives a restart; smshim's runtime prefixes its
            # keys by attempt (see _runtime.init_distributed). Node ranks then come from the
            # rendezvous; the node started with --node-rank 0 hosts its store.
            rdzv = dict(rdzv_backend="c10d", rdzv_endpoint=f"{addr}:{port}",
                        rdzv_configs={"is_host": a.node_rank == 0})
        else:
            rdzv = dict(rdzv_backend="static", rdzv_endpoint=f"{addr}:{port}",
                        rdzv_configs={"rank": a.node_rank})
    config = LaunchConfig(
        min_nodes=a.nnodes, max_nodes=a.nnodes, nproc_per_node=nproc,
        run_id=str(uuid.uuid4()), max_restarts=a.max_restarts, monitor_interval=0.1, **rdzv,
    )
    entry_args = ["-u", "-m", "smshim.launcher.worker", a.script,
                  *hyperparameter_args(hps), *a.script_args]
    return config, entry_args


def run(a: argparse.Namespace) -> int:
    config, entry_args = prepare(a)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    try:
        elastic_launch(config, entrypoint=sys.executable)(*entry_args)
    except ChildFailedError as e:
        logger.error("%s", e.format_msg())
        return 1
    return 0


def main(argv: Optional[List[str]] = None) -> None:
    logging.basicConfig(level=os.environ.get("SMSHIM_LOG_LEVEL", "WARNING"),
                        format="%(name)s: %(message)s")
    a = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if a.command == "timeline":
        raise SystemExit(timeline_plot.run(a))
    raise SystemExit(run(a))
