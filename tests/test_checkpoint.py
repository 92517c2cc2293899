"""smp.save / smp.load / smp.save_checkpoint / smp.resume_from_checkpoint.

Job A (pp=2) trains 4 steps, saving partial checkpoints at steps 1 and 2 (keeping one), a full
one at step 2, and crashing (simulated) in the middle of the step-3 save. Job B (pp=2, a new set
of processes) resumes from `newest` and must reach job A's step-4 state bit for bit. Job C (pp=4)
is refused the pp=2 partial checkpoint with a message naming the degree, and continues from the
full one like job A. The full files also load into a plain module and torch optimizer.
The pipeline runs one microbatch per step here: with several, the engine's gradient accumulation
order varies between runs at the ulp level, which would make "bit-identical" untestable.
"""

import dataclasses
import glob
import os

import torch

from smshim.testing import run_ranks
from tests.pipeline_models import batches, loss_fn, make_model, make_train_step
from tests.test_state_dicts import assert_same

TOL = 1e-5
DATA = batches("net", 4, 8)


@dataclasses.dataclass
class Progress:
    """A user object in user_content (needs full unpickling, not weights_only)."""

    step: int
    note: str


def _setup(cfg):
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    model = smp.DistributedModel(make_model("net"))
    opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))

    train_step = make_train_step("net")

    def train(steps):
        dp, dp_rank = smp.dp_size(), smp.dp_rank()
        for x, y in steps:
            k = x.shape[0] // dp  # each replica trains on its shard of the global batch
            x, y = x[dp_rank * k:(dp_rank + 1) * k], y[dp_rank * k:(dp_rank + 1) * k]
            opt.zero_grad()
            train_step(model, x, y)
            opt.step()

    return smp, model, opt, train


def _full_state(model, opt):
    import copy

    return copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())


def _crashing_writer(real):
    """A stand-in for checkpoint._atomic_write that fails after the first file (a crash)."""
    written = []

    def write(path, fn):
        if written:
            raise OSError(f"simulated crash before writing {os.path.basename(path)}")
        written.append(path)
        real(path, fn)

    return write


def _job_a(d):
    smp, model, opt, train = _setup({"pipeline_parallel_degree": 2, "microbatches": 1})
    import importlib

    # (smp.checkpoint is the activation-checkpointing function; the module is checkpoint.py)
    checkpoint = importlib.import_module("smshim.modelparallel.torch.checkpointing.checkpoint")

    out = {}
    train(DATA[:1])
    smp.save_checkpoint(d, "step1", model=model, optimizer=opt, user_content={"step": 1},
                        num_kept_partial_checkpoints=1)
    train(DATA[1:2])
    smp.save_checkpoint(d, "step2", model=model, optimizer=opt,
                        user_content={"step": 2, "progress": Progress(2, "two")},
                        num_kept_partial_checkpoints=1)
    out["listing_after_step2"] = sorted(os.listdir(d))
    smp.save_checkpoint(os.path.join(d, "full"), "full2.pt", partial=False, model=model,
                        optimizer=opt, user_content={"step": 2})
    out["s2"], out["o2"] = _full_state(model, opt)

    # smp.save/load as Hugging Face uses them: per-rank files found by globbing f + "_*".
    f = os.path.join(d, "hf", "optimizer.pt")
    smp.save(opt.local_state_dict(), f, partial=True)
    smp.save({"whole": torch.arange(3)}, os.path.join(d, "hf", "whole.pt"), partial=False)
    smp.barrier()
    out["hf_glob"] = sorted(os.path.basename(p) for p in glob.glob(f + "_*"))
    out["hf_roundtrip"] = all(
        torch.equal(a, b) for i, st in opt.local_state_dict()["state"].items()
        for a, b in zip(st.values(), smp.load(f, partial=True)["state"][i].values()))
    out["hf_whole"] = smp.load(os.path.join(d, "hf", "whole.pt"), partial=False)["whole"].tolist()

    train(DATA[2:3])
    real = checkpoint._atomic_write
    checkpoint._atomic_write = _crashing_writer(real)
    try:
        smp.save_checkpoint(d, "step3", model=model, optimizer=opt, user_content={"step": 3},
                            num_kept_partial_checkpoints=1)
        out["crash"] = None
    except Exception as e:  # noqa: BLE001
        out["crash"] = f"{type(e).__name__}: {e}"
    finally:
        checkpoint._atomic_write = real
    with open(os.path.join(d, "newest")) as fh:
        out["newest_after_crash"] = fh.read()
    train(DATA[3:])
    out["s4"], out["o4"] = _full_state(model, opt)
    return out


def _job_b(d):
    smp, model, opt, train = _setup({"pipeline_parallel_degree": 2, "microbatches": 1})
    # tag None: `newest`. Its user_content holds a Progress object: full unpickling, opted in.
    user_content = smp.resume_from_checkpoint(d, weights_only=False)
    train(DATA[2:])
    s4, o4 = _full_state(model, opt)
    return {"user_content": user_content, "s4": s4, "o4": o4}


def _job_c(d):
    smp, model, opt, train = _setup({"pipeline_parallel_degree": 4, "microbatches": 1})
    try:
        smp.resume_from_checkpoint(d, tag="step2")
        partial_error = None
    except Exception as e:  # noqa: BLE001
        partial_error = f"{type(e).__name__}: {e}"
    user_content = smp.resume_from_checkpoint(os.path.join(d, "full"), tag="full2.pt",
                                              partial=False)
    train(DATA[2:])
    s4, o4 = _full_state(model, opt)
    return {"partial_error": partial_error, "user_content": user_content, "s4": s4, "o4": o4}


def test_partial_resume_crash_safety_and_full_checkpoint_at_other_degrees(tmp_path):
    d = str(tmp_path / "ckpt")
    a = run_ranks(_job_a, 2, d, timeout=150)
    r = a[0]
    # Rotation kept one partial checkpoint; the crash left `newest` on the last complete one.
    assert "step1_partial" not in r["listing_after_step2"]
    assert {"step2_partial", "newest", "user_content.pt"} <= set(r["listing_after_step2"])
    assert sorted(os.listdir(os.path.join(d, "step2_partial"))) == [
        "model_0_0.pt", "model_1_0.pt", "optimizer_0_0.pt", "optimizer_1_0.pt", "user_content.pt"]
    for x in a:
        assert x["crash"] is not None and "simulated crash" in x["crash"], x["crash"]
        assert x["newest_after_crash"] == "step2"
        assert x["hf_glob"] == ["optimizer.pt_0_0", "optimizer.pt_1_0"]
        assert x["hf_roundtrip"] and x["hf_whole"] == [0, 1, 2]
    assert not [p for p in glob.glob(os.path.join(d, "**", ".*"), recursive=True)], "temp files"
    assert_same(a[1]["s4"], r["s4"])

    # A new job resumes from `newest` (step 2) and reaches job A's step 4 exactly.
    b = run_ranks(_job_b, 2, d, timeout=150)
    for x in b:
        assert x["user_content"] == {"step": 2, "progress": Progress(2, "two")}
        assert_same(x["s4"], r["s4"], where="resumed model@4")
        assert_same(x["o4"], r["o4"], where="resumed optimizer@4")

    # The full checkpoint is a plain state dict: a single-process module and torch optimizer
    # load it, and continue like the pipeline did.
    module = make_model("net")
    module.load_state_dict(torch.load(os.path.join(d, "full", "full2.pt")))
    assert_same(module.state_dict(), r["s2"], where="plain module")
    plain_opt = torch.optim.Adam(module.parameters(), lr=0.01)
    plain_opt.load_state_dict(torch.load(os.path.join(d, "full", "full2.pt_optimizer.pt")))
    for x, y in DATA[2:]:
        plain_opt.zero_grad()
        loss_fn("net", module(x, scale=0.5), y).backward()
        plain_opt.step()
    assert_same(module.state_dict(), r["s4"], TOL, "single-process continuation")

    # pp=4: the pp=2 partial checkpoint is refused, naming the degree; the full one continues.
    c = run_ranks(_job_c, 4, d, timeout=150)
    for x in c:
        assert "pipeline_parallel_degree=2" in x["partial_error"], x["partial_error"]
        assert x["user_content"] == {"step": 2}
        assert_same(x["s4"], r["s4"], TOL, "pp=4 continuation")
        assert_same(x["o4"], r["o4"], TOL, "pp=4 optimizer")


def _job_ddp(d):
    cfg = {"pipeline_parallel_degree": 2, "microbatches": 1, "ddp": True,
           "placement_strategy": "spread"}
    smp, model, opt, train = _setup(cfg)
    train(DATA[:2])
    smp.save_checkpoint(d, "step2", model=model, optimizer=opt, user_content={"step": 2})
    smp.save_checkpoint(d, "full2.pt", partial=False, model=model, optimizer=opt)
    s2 = _full_state(model, opt)[0] if smp.dp_rank() == 0 else None
    train(DATA[2:])
    s4, o4 = _full_state(model, opt)
    # Start over in this job from the files alone: a fresh model, resumed before partitioning.
    smp.reset()
    smp, model, opt, train = _setup(cfg)
    try:
        smp.resume_from_checkpoint(d)  # `newest` names the full checkpoint, saved last
        newest_error = None
    except Exception as e:  # noqa: BLE001
        newest_error = str(e)
    user_content = smp.resume_from_checkpoint(d, tag="step2")
    train(DATA[2:])
    r4, ro4 = _full_state(model, opt)
    return {"pp_dp": (smp.pp_rank(), smp.dp_rank()), "s2": s2, "s4": s4, "o4": o4, "r4": r4,
            "ro4": ro4, "user_content": user_content, "newest_error": newest_error}


def test_save_resume_with_data_parallel_replicas(tmp_path):
    d = str(tmp_path / "ckpt")
    res = run_ranks(_job_ddp, 4, d, timeout=150)
    assert [x["pp_dp"] for x in res] == [(0, 0), (0, 1), (1, 0), (1, 1)]  # spread
    # Only the dp_rank 0 replica wrote partial files, one per pp rank.
    assert sorted(os.listdir(os.path.join(d, "step2_partial"))) == [
        "model_0_0.pt", "model_1_0.pt", "optimizer_0_0.pt", "optimizer_1_0.pt", "user_content.pt"]
    for x in res:
        assert x["user_content"] == {"step": 2}
        assert "is a full checkpoint" in x["newest_error"] and "partial=False" in x["newest_error"]
        assert_same(x["s4"], res[0]["s4"], where="replicas agree")
        assert_same(x["r4"], res[0]["s4"], where="resumed model@4")
        assert_same(x["ro4"], res[0]["o4"], where="resumed optimizer@4")
    module = make_model("net")
    module.load_state_dict(torch.load(os.path.join(d, "full2.pt")))
    assert_same(module.state_dict(), res[0]["s2"], where="full checkpoint")


def _job_pp1(d):
    smp, model, opt, train = _setup({"pipeline_parallel_degree": 1})
    train(DATA[:2])
    smp.save_checkpoint(d, "p", model=model, optimizer=opt, user_content=Progress(2, "p"))
    smp.save_checkpoint(d, "f.pt", partial=False, model=model, optimizer=opt)
    train(DATA[2:])
    s4, o4 = _full_state(model, opt)
    out = {}
    for partial, tag in ((True, "p"), (False, "f.pt")):
        smp.reset()
        smp, model, opt, train = _setup({"pipeline_parallel_degree": 1})
        out[tag] = smp.resume_from_checkpoint(d, tag=tag, partial=partial)
        train(DATA[2:])
        out[tag, "state"] = _full_state(model, opt)
    return s4, o4, out


def test_pp1_partial_and_full_checkpoints(tmp_path):
    s4, o4, out = run_ranks(_job_pp1, 1, str(tmp_path), timeout=120,
                            env={"SMSHIM_ALLOW_PICKLE": "1"})[0]  # Progress needs full unpickling
    assert out["p"] == Progress(2, "p") and out["f.pt"] is None
    for tag in ("p", "f.pt"):
        assert_same(out[tag, "state"], (s4, o4), where=f"pp=1 resume from {tag}")


class _RunsCode:
    """Unpickling this calls os.makedirs(marker): what a crafted checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _job_crafted(d):
    import smdistributed.modelparallel.torch as smp

    smp.init({"pipeline_parallel_degree": 1})
    model = smp.DistributedModel(make_model("net"))
    smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
    marker = os.path.join(d, "code_ran")
    # Files smshim did not write (smshim's own files are signed and trusted: see
    # test_checkpoint_signing.py): a plain torch.save, and a checkpoint whose user_content was
    # replaced by one.
    torch.save({"weights": torch.ones(2), "payload": _RunsCode(marker)}, os.path.join(d, "f.pt"))
    smp.save_checkpoint(d, "t", model=model, optimizer=None, user_content={"step": 1})
    torch.save(_RunsCode(marker), os.path.join(d, "t_partial", "user_content.pt"))
    out = {}
    for what, load in (("load", lambda **kw: smp.load(os.path.join(d, "f.pt"), partial=False, **kw)),
                       ("resume", lambda **kw: smp.resume_from_checkpoint(d, load_optimizer=False,
                                                                          **kw))):
        try:
            load()
            out[what] = None
        except smp.UnsafeCheckpointError as e:
            out[what] = str(e)
        out[what, "ran_before_opt_in"] = os.path.exists(marker)
        os.environ["SMSHIM_ALLOW_PICKLE"] = "0"  # the argument wins over the environment
        loaded = load(weights_only=False)
        out[what, "ran_after_opt_in"] = os.path.exists(marker)
        out[what, "weights"] = loaded["weights"].tolist() if what == "load" else None
        os.rmdir(marker)
    os.environ["SMSHIM_ALLOW_PICKLE"] = "1"
    smp.load(os.path.join(d, "f.pt"), partial=False)  # the environment switch alone
    out["env_opt_in"] = os.path.exists(marker)
    return out


def test_crafted_checkpoint_is_refused_unless_opted_in(tmp_path):
    out = run_ranks(_job_crafted, 1, str(tmp_path), timeout=90)[0]
    for what, name in (("load", "f.pt"), ("resume", "user_content.pt")):
        msg = out[what]
        assert msg is not None, f"{what}: a file that runs code was loaded without opt-in"
        assert name in msg and "weights_only=False" in msg and "SMSHIM_ALLOW_PICKLE=1" in msg, msg
        assert not out[what, "ran_before_opt_in"], f"{what}: code ran although refused"
        assert out[what, "ran_after_opt_in"]
    assert out["load", "weights"] == [1.0, 1.0]
    assert out["env_opt_in"]
