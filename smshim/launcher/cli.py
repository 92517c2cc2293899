"""`smshim run`: launch a training script on N processes per node, torchrun-style.

Built on torchrun's launcher API (`torch.distributed.launcher.api`): the elastic agent starts,
watches and tears down the workers. On top of it, `--distribution` / `--hyperparameters` take a
SageMaker estimator's arguments and set what the SageMaker container would, so a SageMaker job
definition runs unchanged on a laptop or a cluster.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import uuid
from typing import Dict, List, NoReturn, Optional, Sequence

from smshim import __version__
from smshim.timeline import plot as timeline_plot
from smshim.launcher.sagemaker_env import (
    Distribution,
    DistributionError,
    check_launcher_available,
    container_hyperparameters,
    hyperparameter_args,
    job_environment,
    load_json_arg,
    parse_distribution,
)

logger = logging.getLogger("smshim.run")

DESCRIPTION = """\
Run a training script on N processes per node, as torchrun does, with the environment a
SageMaker training container gives it. A script written for SageMaker (smdistributed.dataparallel,
smdistributed.modelparallel, torch.sagemaker, plain DDP) runs unchanged: pass the estimator's
distribution and hyperparameters as they are."""

EPILOG = """\
process count:
  processes = nodes x processes per node. For smdistributed.modelparallel it must be a multiple of
  pipeline_parallel_degree x tensor_parallel_degree, and larger than that product only with
  "ddp": true (processes = pipeline x tensor x data parallel degree). smshim run checks this before
  starting any process.

examples:
  smshim run -n 2 train.py --epochs 3
  smshim run --distribution '{"smdistributed": {"modelparallel": {"enabled": true,
      "parameters": {"partitions": 2, "microbatches": 4, "ddp": true}}},
      "mpi": {"enabled": true, "processes_per_host": 4}}' train_smp.py
  smshim run -n 2 --distribution "{'smdistributed': {'dataparallel': {'enabled': True}}}" train.py
  smshim run -n 4 --distribution @distribution.json --hyperparameters @hps.json train.py
  smshim run -n 2 --distribution '{"torch_distributed": {"enabled": true}}' train_v2.py
  smshim run -n 2 --cpu train_written_for_gpus.py
  # two nodes (run on each; node-rank 0 on the master host):
  smshim run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 -n 8 train.py

environment variables:
  SMSHIM_CPU=1        CPU mode under any launcher (what --cpu sets)
  SMSHIM_RUN_ID       the job's run id (what --run-id sets)
  SMSHIM_TIMEOUT      seconds every collective and wait may take (default 1800)
  SMSHIM_LOG_LEVEL    smshim's log level (default WARNING)
  SMSHIM_ALIAS        auto | force | 0: the smdistributed import alias
  SMP_MANUAL_INIT=1   importing smp does not initialise it; the script's smp.init(config) does
  SM_HP_MP_PARAMETERS the smp config as JSON (set by --distribution)

more: docs/launching.md"""


def _parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(
        prog="smshim", formatter_class=fmt,
        description="smshim: run SageMaker distributed-training scripts (smdistributed, "
                    "torch.sagemaker) on plain torch.distributed.",
        epilog="Run 'smshim run --help' for the launcher's options and examples.")
    p.add_argument("--version", action="version", version=f"smshim {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="command")
    r = sub.add_parser("run", help="run a training script on several processes",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=fmt)
    r.add_argument("-n", "--nproc-per-node", "--nproc_per_node", type=int, default=None,
                   metavar="N",
                   help="processes per node (default: mpi.processes_per_host, else one per GPU, "
                        "else 1)")
    r.add_argument("--nnodes", type=int, default=1, metavar="N",
                   help="number of nodes (hosts); run the same command on each (default 1)")
    r.add_argument("--node-rank", "--node_rank", type=int, default=0, metavar="I",
                   help="this node's index, 0..nnodes-1; node 0 hosts the rendezvous")
    r.add_argument("--master-addr", "--master_addr", default=None, metavar="ADDR",
                   help="address of node 0, reachable from every node (needed with --nnodes > 1)")
    r.add_argument("--master-port", "--master_port", type=int, default=None, metavar="PORT",
                   help="rendezvous port on node 0 (default: 29500 with several nodes, else a "
                        "free port)")
    r.add_argument("--run-id", default=None, metavar="ID",
                   help="the job's id, the same on every node (torchrun's --rdzv-id; default: "
                        "$SMSHIM_RUN_ID, else derived from --master-addr and --master-port)")
    r.add_argument("--rdzv-timeout", type=int, default=900, metavar="SECONDS",
                   help="how long a node waits for the others before failing (default 900)")
    r.add_argument("--distribution", default=None, metavar="DIST",
                   help="a SageMaker estimator's distribution: JSON, a Python dict literal "
                        "(True, single quotes) or @file.json. Kinds: smdistributed (+ mpi), "
                        "torch_distributed, pytorchddp, pytorchxla")
    r.add_argument("--hyperparameters", default=None, metavar="HPS",
                   help="a SageMaker estimator's hyperparameters (JSON, Python dict or "
                        "@file.json): each reaches the script as --name value and SM_HP_<NAME>")
    r.add_argument("--channel", action="append", default=[], metavar="NAME=PATH",
                   help="a data channel: sets SM_CHANNEL_<NAME> (repeatable)")
    r.add_argument("--max-restarts", "--max_restarts", type=int, default=0, metavar="N",
                   help="restart the whole worker group up to N times after a worker fails "
                        "(torchrun's meaning); scripts resume from their newest checkpoint")
    r.add_argument("--output-dir", default="smshim_output", metavar="DIR",
                   help="where SM_MODEL_DIR (DIR/model) and SM_OUTPUT_DATA_DIR (DIR/output/data) "
                        "point; always set (default ./smshim_output)")
    r.add_argument("--log-dir", default=None, metavar="DIR",
                   help="where each rank's stderr.log goes (default: <output-dir>/logs)")
    r.add_argument("--tee", action="store_true",
                   help="print every rank's stderr as it is, tracebacks included (default: "
                        "tracebacks go to the log files and a failure prints one summary)")
    r.add_argument("--cpu", action="store_true",
                   help="CPU mode: run a GPU script's torch.cuda.set_device, .cuda(), "
                        ".to('cuda'), DDP device_ids and cuda map_locations on the CPU "
                        "(SMSHIM_CPU=1 does the same under torchrun or mpirun)")
    r.add_argument("script", help="the training script")
    r.add_argument("script_args", nargs=argparse.REMAINDER,
                   help="arguments for the script (after the hyperparameters)")
    t = sub.add_parser("timeline", help="draw a pipeline timeline (SMSHIM_TRACE=DIR) as a PNG",
                       description="Draw the traces a run wrote with SMSHIM_TRACE=DIR as a PNG: one row per "
                                   "rank, forward, backward, weight gradients, transfers and waits.")
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


def _check_smp_v1(dist: Distribution, world_size: int) -> None:
    """The smp parameters and process count, checked by the resolver the workers will use."""
    if not dist.modelparallel or dist.smp_v2:
        return
    from smshim.modelparallel.torch.config import resolve_config
    from smshim.modelparallel.torch.errors import SMPConfigError, SMPUnsupportedError

    try:
        resolve_config(dist.mp_parameters, world_size, env={})
    except (SMPConfigError, SMPUnsupportedError) as e:
        _fail(f"distribution field smdistributed.modelparallel.parameters: {e} "
              f"(with {world_size} processes; fix the parameters or the process count)")


def prepare(a: argparse.Namespace) -> tuple:
    """Validate the `run` arguments and set the job's environment; returns (LaunchConfig, args).

    Everything that can be wrong is found here, before any process starts.
    """
    try:
        dist = parse_distribution(a.distribution) if a.distribution else Distribution()
        check_launcher_available(dist)
        hps = load_json_arg(a.hyperparameters, "--hyperparameters") if a.hyperparameters else {}
    except DistributionError as e:
        _fail(str(e))
    if not isinstance(hps, dict):
        _fail("--hyperparameters must be an object (dict) of name: value")
    if a.nnodes < 1 or not (0 <= a.node_rank < a.nnodes):
        _fail(f"--node-rank {a.node_rank} must be in [0, --nnodes {a.nnodes})")
    if a.nnodes > 1 and not a.master_addr:
        _fail("--nnodes > 1 needs --master-addr (the address of node 0) and --master-port")
    if not os.path.exists(a.script):
        _fail(f"script {a.script!r} not found")
    if a.max_restarts < 0:
        _fail(f"--max-restarts must be >= 0, got {a.max_restarts}")
    if a.rdzv_timeout < 1:
        _fail(f"--rdzv-timeout must be >= 1 second, got {a.rdzv_timeout}")
    nproc = _nproc(a.nproc_per_node, dist)
    _check_smp_v1(dist, nproc * a.nnodes)
    channels = _channels(a.channel)

    import torch
    from torch.distributed.launcher.api import LaunchConfig

    from smshim.launcher.worker_logs import TailingLogsSpecs

    if a.cpu:
        from smshim.runtime import cpu_mode

        os.environ["SMSHIM_CPU"] = "1"  # the workers' start-up hook maps the CUDA calls
        cpu_mode.warn_once(cuda_available=torch.cuda.is_available())
    hps = container_hyperparameters(dist, hps)
    # The container contract holds for every job: scripts read SM_MODEL_DIR & co. unconditionally.
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

    rid = None
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
        rid = a.run_id or os.environ.get("SMSHIM_RUN_ID")
    else:
        from smshim.launcher import multinode

        multinode.register()
        addr = a.master_addr
        port = a.master_port or 29500
        rid = multinode.run_id(a.run_id, addr, port, a.nnodes)
        if a.max_restarts > 0:
            # torchrun's recommendation for restarts: the c10d rendezvous (measured with torch
            # 2.13: the static one's new attempt dialed the old attempt's gloo addresses). The
            # store it shares with the workers outlives a restart; smshim's runtime prefixes its
            # keys by attempt (see _runtime.init_distributed). Node ranks then come from the
            # rendezvous; the node started with --node-rank 0 hosts its store.
            rdzv = dict(rdzv_backend=multinode.C10D, rdzv_endpoint=f"{addr}:{port}",
                        rdzv_configs={"is_host": a.node_rank == 0, "join_timeout": a.rdzv_timeout,
                                      "read_timeout": a.rdzv_timeout})
        else:
            rdzv = dict(rdzv_backend=multinode.STATIC, rdzv_endpoint=f"{addr}:{port}",
                        rdzv_configs={"rank": a.node_rank, "timeout": a.rdzv_timeout})
    log_dir = os.path.abspath(a.log_dir or os.path.join(a.output_dir, "logs"))
    config = LaunchConfig(
        min_nodes=a.nnodes, max_nodes=a.nnodes, nproc_per_node=nproc,
        run_id=rid or str(uuid.uuid4()), max_restarts=a.max_restarts, monitor_interval=0.1,
        logs_specs=TailingLogsSpecs(log_dir, tee_all=a.tee), **rdzv,
    )
    entry_args = ["-u", "-m", "smshim.launcher.worker", a.script,
                  *hyperparameter_args(hps), *a.script_args]
    return config, entry_args


def _report_failure(e, script: str, logs_specs) -> None:
    from smshim.launcher.worker_logs import failure_summary

    attempt = logs_specs.attempt_dirs[-1] if logs_specs.attempt_dirs else ""
    logs = {rank: os.path.join(attempt, str(f.local_rank), "stderr.log")
            for rank, f in e.failures.items() if attempt}
    for line in failure_summary(e.failures, script, logs):
        print(f"smshim run: {line}", file=sys.stderr)


def run(a: argparse.Namespace, quiet: bool = True) -> int:
    config, entry_args = prepare(a)
    if quiet:
        config.logs_specs.exits.install()  # the workers' exit codes, for the restart message
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous import RendezvousError
    from torch.distributed.launcher.api import elastic_launch

    try:
        elastic_launch(config, entrypoint=sys.executable)(*entry_args)
    except ChildFailedError as e:
        config.logs_specs.close()
        _report_failure(e, a.script, config.logs_specs)
        return 1
    except RendezvousError as e:
        print(f"smshim run: error: {e}", file=sys.stderr)
        return 3
    finally:
        config.logs_specs.close()
    return 0


def main(argv: Optional[List[str]] = None) -> None:
    level = os.environ.get("SMSHIM_LOG_LEVEL", "WARNING").upper()
    logging.basicConfig(level=level, format="%(name)s: %(message)s")
    if logging.getLevelName(level) not in (logging.DEBUG, logging.INFO):
        # torch's elastic agent logs every worker's exit and a pointer to its docs; the failure
        # summary says what matters (SMSHIM_LOG_LEVEL=INFO shows them again).
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        quiet = True
    else:
        quiet = False
    a = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if a.command == "timeline":
        raise SystemExit(timeline_plot.run(a))
    raise SystemExit(run(a, quiet))
