"""smp object communication in every group kind (torchrun-style env via run_ranks, and mpirun),
auto-init on import under launchers, bounded waits, and smp.amp.GradScaler across the PP group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from smshim.testing import held_port, run_command, run_ranks
from tests.smp_scripts.comm_checks import check_all

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "smp_scripts", "smp_comm_main.py")
ENV = "SM_HP_MP_PARAMETERS"


def _results(out_dir) -> list:
    rows = []
    for name in sorted(os.listdir(out_dir)):
        with open(os.path.join(out_dir, name)) as f:
            rows.append(json.load(f))
    return sorted(rows, key=lambda r: r["rank"])


def test_comm_4_ranks_pp2_ddp():
    results = run_ranks(check_all, 4, {"partitions": 2, "ddp": True}, timeout=120)
    # cluster, pp=2, dp=2: pp_rank = rank % 2, dp_rank = rank // 2.
    for r, res in enumerate(results):
        assert res["rank"] == r and res["size"] == 4 and not res["at_import"]
        assert (res["pp_rank"], res["dp_rank"]) == (r % 2, r // 2)
        pp = [r - r % 2, r - r % 2 + 1]
        dp = [r % 2, r % 2 + 2]
        assert res["gathered"] == {"WORLD": [0, 1, 2, 3], "PP_GROUP": pp, "TP_GROUP": [r],
                                   "RDP_GROUP": dp, "DP_GROUP": dp, "MP_GROUP": pp}
        assert "not in this rank's WORLD" in res["errors"][0]
        assert "itself" in res["errors"][1]


def _mpirun(out_dir, env: dict, *args: str) -> list:
    full_env = {"SMSHIM_TIMEOUT": "60", "SMP_RESULT_DIR": str(out_dir), "MASTER_ADDR": None,
                "MASTER_PORT": None, **env}
    run_command(["mpirun", "-n", "2", sys.executable, SCRIPT, *args], timeout=120,
                env=full_env, cwd=ROOT)
    return _results(out_dir)


def test_comm_under_mpirun_auto_init(tmp_path):
    # SM_HP_MP_PARAMETERS + MPI: the import itself initialises smp.
    results = _mpirun(tmp_path, {ENV: json.dumps({"partitions": 2}), "SMP_MANUAL_INIT": None})
    assert [r["rank"] for r in results] == [0, 1]
    for r, res in enumerate(results):
        assert res["at_import"] and res["launcher"] == "mpich"
        assert res["pipeline_parallel_degree"] == 2 and res["pp_rank"] == r
        assert res["gathered"]["PP_GROUP"] == [0, 1] and res["gathered"]["DP_GROUP"] == [r]


def test_mpirun_manual_init(tmp_path):
    # SMP_MANUAL_INIT=1: no init on import; the script's own smp.init(config) merges with the env.
    # With no MASTER_PORT from the launcher, ddp_port becomes the rendezvous port.
    with held_port() as port:
        results = _mpirun(tmp_path, {ENV: json.dumps({"microbatches": 2}), "SMP_MANUAL_INIT": "1"},
                          json.dumps({"ddp": True, "ddp_port": port}))
    for r, res in enumerate(results):
        assert not res["at_import"] and res["master_port"] == str(port)
        assert res["pipeline_parallel_degree"] == 1 and res["dp_rank"] == r
        assert res["gathered"]["DP_GROUP"] == [0, 1]


def test_auto_init_under_torchrun(tmp_path):
    out = tmp_path / "results"
    out.mkdir()
    with held_port() as port:
        # (--log-dir: else torchrun leaves an empty log directory in the system's temp dir)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1",
               "--log-dir", str(tmp_path / "logs"), "--nproc-per-node", "2",
               "--master-addr", "127.0.0.1", "--master-port", str(port), SCRIPT]
        run_command(cmd, timeout=120, cwd=ROOT,
                    env={ENV: json.dumps({"partitions": 2}), "SMP_MANUAL_INIT": None,
                         "SMSHIM_TIMEOUT": "60", "SMP_RESULT_DIR": str(out)})
    results = _results(out)
    assert [r["rank"] for r in results] == [0, 1]
    for r, res in enumerate(results):
        assert res["at_import"] and res["launcher"] == "torchrun" and res["local_rank"] == r
        assert res["pp_rank"] == r


def test_no_auto_init_without_launcher():
    code = "import smdistributed.modelparallel.torch as smp; print('INIT', smp.is_initialized())"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMI_SIZE")}
    env[ENV] = json.dumps({"partitions": 1})
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert "INIT False" in out.stdout


def _timeouts_rank():
    import smshim.modelparallel.torch as smp
    from smshim.modelparallel.torch.errors import SMPRuntimeError

    smp.init({"ddp": True})
    out = {}
    os.environ["SMSHIM_TIMEOUT"] = "1.5"
    if smp.rank() == 1:
        t0 = time.monotonic()
        try:
            smp.recv_from(0, smp.WORLD_RANK)  # rank 0 never sends
        except SMPRuntimeError as e:
            out["recv"] = (str(e), time.monotonic() - t0)
    os.environ["SMSHIM_TIMEOUT"] = "60"
    smp.barrier()
    os.environ["SMSHIM_TIMEOUT"] = "1.5"
    if smp.rank() == 1:
        t0 = time.monotonic()
        try:
            smp.allgather("x", smp.WORLD)  # rank 0 never joins
        except SMPRuntimeError as e:
            out["allgather"] = (str(e), time.monotonic() - t0)
    else:
        time.sleep(3)
    return out


def test_waits_are_bounded_and_name_the_peer():
    _, r1 = run_ranks(_timeouts_rank, 2, timeout=60)
    msg, elapsed = r1["recv"]
    assert "global rank 0" in msg and "SMSHIM_TIMEOUT" in msg and 1.0 < elapsed < 10, r1
    msg, elapsed = r1["allgather"]
    assert "global rank 0" in msg and "allgather" in msg and elapsed < 10, r1


def _late_receiver_rank():
    import smshim.modelparallel.torch as smp

    smp.init({"partitions": 2})
    big = torch.arange(3 * 2**20, dtype=torch.float32)  # 12 MB: more than one store value
    if smp.rank() == 0:
        for i in range(5):
            smp.send((i, big if i == 4 else None), 1, smp.PP_RANK)
        return "sent"  # leaves at once; its process hosts the store
    time.sleep(1.0)
    got = [smp.recv_from(0, smp.PP_RANK) for _ in range(5)]
    assert [g[0] for g in got] == list(range(5)) and torch.equal(got[4][1], big)
    return "received"


def test_sends_are_buffered_and_survive_an_early_exit_of_rank0():
    assert run_ranks(_late_receiver_rank, 2, timeout=60) == ["sent", "received"]


# smp.amp.GradScaler ---------------------------------------------------------------------------------
def _scaler_rank():
    import smshim.modelparallel.torch as smp

    smp.init({"partitions": 2})
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = smp.amp.GradScaler(init_scale=4.0)
    if smp.pp_rank() == 0:
        scaler.scale(torch.tensor(1.0))  # only the first stage computes the loss
    history = []
    inf = float("inf")
    # Step 1: only pp_rank 1 sees an inf -> both stages skip and back off.
    p.grad = torch.tensor([inf, 4.0]) if smp.pp_rank() == 1 else torch.full((2,), 4.0)
    scaler.step(opt)
    scaler.update()
    history.append((p.detach().tolist(), scaler.get_scale()))
    # Step 2: finite everywhere -> both step with grads unscaled by 2.
    p.grad = torch.full((2,), 4.0)
    scaler.unscale_(opt)
    unscaled = p.grad.tolist()
    scaler.step(opt)
    scaler.update()
    history.append((p.detach().tolist(), scaler.get_scale(), unscaled))
    # Step 3: pp_rank 0 sees a NaN, pp_rank 1 has no gradient at all -> both skip.
    p.grad = torch.tensor([float("nan"), 0.0]) if smp.pp_rank() == 0 else None
    scaler.step(opt)
    scaler.update()
    history.append((p.detach().tolist(), scaler.get_scale()))
    return history


def test_grad_scaler_combines_found_inf_over_pp():
    r0, r1 = run_ranks(_scaler_rank, 2, timeout=60)
    for h in (r0, r1):
        assert h[0] == ([1.0, 1.0], 2.0)
        assert h[1] == ([-1.0, -1.0], 2.0, [2.0, 2.0])
        assert h[2] == ([-1.0, -1.0], 1.0)


def test_grad_scaler_without_smp_is_torchs():
    from smshim.modelparallel.torch.amp import GradScaler

    p = torch.nn.Parameter(torch.ones(1))
    opt = torch.optim.SGD([p], lr=1.0)
    scaler = GradScaler(init_scale=2.0)
    (scaler.scale(p * 3).sum()).backward()  # grad 6 scaled, 3 unscaled
    scaler.step(opt)
    scaler.update()
    assert p.item() == pytest.approx(-2.0) and scaler.get_scale() == 2.0
    p.grad = torch.tensor([float("inf")])
    scaler.step(opt)
    scaler.update()
    assert p.item() == pytest.approx(-2.0) and scaler.get_scale() == 1.0
