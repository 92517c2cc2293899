"""Full and partial state dicts of smp.DistributedModel / DistributedOptimizer (pp = 1 and 2).

One multi-process run per pp degree covers both models (a buffered Net and the tied-weight LM):
the full state equals single-process training, the partial ones hold exactly the rank's entries,
and full/partial dicts load back (after and before partitioning) so that training continues
bit-identically.
"""

import copy

import pytest
import torch

from smshim.testing import run_ranks
from tests.pipeline_models import Block, Net, TiedLM, batches, loss_fn

TOL = 1e-5
# Replays after a load run the same step again. With microbatches > 1 the engine accumulates
# parameter gradients in microbatch completion order, which varies run to run (ulp-level), so
# replays are compared within this bound; the loaded states themselves must match exactly.
REPLAY_TOL = 1e-6
KINDS = ("bufnet", "tied")


class GainBlock(Block):
    """A block with a persistent buffer used in forward and a non-persistent one."""

    def __init__(self, d: int) -> None:
        super().__init__(d)
        self.register_buffer("gain", torch.linspace(0.5, 1.5, d))
        self.register_buffer("scratch", torch.zeros(d), persistent=False)

    def forward(self, x, scale=1.0):
        return super().forward(x, scale) * self.gain


def make(kind):
    torch.manual_seed(0)
    if kind == "tied":
        return TiedLM()
    m = Net()
    m.blocks[2] = GainBlock(16)
    return m


def data_kind(kind):
    return "net" if kind == "bufnet" else "lm"


def perturbed(kind):
    """A full state dict different from make(kind)'s (a non-default starting point)."""
    g = torch.Generator().manual_seed(7)
    sd = make(kind).state_dict()
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in sd.items()}


def reference(kind, init_sd, steps, batch=8):
    """Single-process training from `init_sd`: (model state, optimizer state) per step."""
    model = make(kind)
    model.load_state_dict(init_sd)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    out = []
    for x, y in batches(data_kind(kind), steps, batch):
        opt.zero_grad()
        pred = model(x, scale=0.5) if kind == "bufnet" else model(x)
        loss_fn(data_kind(kind), pred, y).backward()
        opt.step()
        out.append((copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())))
    return out


def assert_same(a, b, tol=None, where="state"):
    """Recursive equality of state dicts: exact (torch.equal) or within `tol`."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.shape == b.shape and a.dtype == b.dtype, (where, a.shape, b.shape)
        if tol is None:
            assert torch.equal(a, b), f"{where}: differs"
        else:
            diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
            assert diff <= tol, f"{where}: max abs diff {diff}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), (where, list(a), list(b))
        for k in a:
            assert_same(a[k], b[k], tol, f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, tol, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def _errors(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def _job(pp):
    """Runs on every rank; returns what the test checks."""
    import smdistributed.modelparallel.torch as smp

    smp.init({"pipeline_parallel_degree": pp, "microbatches": 2})
    out = {}
    for kind in KINDS:
        def build():
            smp.reset()
            model = smp.DistributedModel(make(kind))
            opt = smp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01))
            return model, opt

        @smp.step
        def train_step(model, x, y):
            pred = model(x, scale=0.5) if kind == "bufnet" else model(x)
            loss = loss_fn(data_kind(kind), pred, y)
            model.backward(loss)
            return loss

        data = batches(data_kind(kind), 3, 8)

        def train(model, opt, steps):
            for x, y in steps:
                opt.zero_grad()
                train_step(model, x, y)
                opt.step()

        r = {}
        model, opt = build()
        r["pre"] = copy.deepcopy(model.state_dict())
        model.load_state_dict(perturbed(kind))  # full, before partitioning
        train(model, opt, data[:2])
        s2, o2 = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        l2, lo2 = copy.deepcopy(model.local_state_dict()), copy.deepcopy(opt.local_state_dict())
        train(model, opt, data[2:])
        s3, o3 = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        r.update(s2=s2, o2=o2, s3=s3, o3=o3, l2=l2, lo2=lo2)
        r["on_cpu"] = all(v.device.type == "cpu" for v in s3.values())

        # Full dicts load back after partitioning; the next step is the same as the first time.
        # (torch optimizers adopt the loaded tensors, as torch's own load_state_dict does: copies)
        model.load_state_dict(s2)
        opt.load_state_dict(copy.deepcopy(o2))
        r["full_reload"] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        # torch's load replaced the wrapped optimizer's groups/state: still shared (lr schedulers)
        r["shared"] = (opt.param_groups is opt.optimizer.param_groups
                       and opt.state is opt.optimizer.state)
        train(model, opt, data[2:])
        r["full_reload_step3"] = (copy.deepcopy(model.state_dict()),
                                  copy.deepcopy(opt.state_dict()))
        # Partial dicts likewise.
        model.load_state_dict(l2)
        opt.load_state_dict(copy.deepcopy(lo2))
        r["partial_reload"] = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))

        # Misuse: each names what is wrong.
        wrong_pp = dict(l2, _smp_pp_size=4)
        r["err_pp"] = _errors(lambda: model.load_state_dict(wrong_pp))
        r["err_opt_pp"] = _errors(lambda: opt.load_state_dict(dict(lo2, _smp_pp_size=4)))
        r["err_rank"] = _errors(lambda: model.load_state_dict(
            dict(l2, _smp_pp_rank=(smp.pp_rank() + 1) % 2)))
        r["dropped"] = drop = list(s2)[-1]  # head.bias; out.weight (tied to embed.weight)
        missing = {k: v for k, v in s2.items() if k != drop}
        r["err_missing"] = _errors(lambda: model.load_state_dict(missing))
        r["err_extra"] = _errors(lambda: model.load_state_dict(dict(l2, bogus=torch.zeros(1))))
        r["nonstrict"] = _errors(lambda: model.load_state_dict(missing, strict=False))

        # Partial dicts given before partitioning are applied right after it, exactly once.
        model, opt = build()
        model.load_state_dict(l2)
        opt.load_state_dict(copy.deepcopy(lo2))
        train(model, opt, data[2:])
        r["deferred_partial_step3"] = (copy.deepcopy(model.state_dict()),
                                       copy.deepcopy(opt.state_dict()))
        r["hooks_left"] = len(model._post_partition_hooks)
        # A full optimizer dict before partitioning (the model's full dict applies at once).
        model, opt = build()
        model.load_state_dict(s2)
        opt.load_state_dict(copy.deepcopy(o2))
        train(model, opt, data[2:])
        r["deferred_full_step3"] = (copy.deepcopy(model.state_dict()),
                                    copy.deepcopy(opt.state_dict()))
        out[kind] = r
    return out


def _check(results, pp):
    for kind in KINDS:
        rs = [res[kind] for res in results]
        r = rs[0]
        plain = make(kind)
        ref = reference(kind, perturbed(kind), 3)
        # Before partitioning: the module's own state dict.
        assert_same(r["pre"], plain.state_dict(), where=f"{kind} pre")
        # Full state: keys (order included) as the unwrapped module's, values as single-process
        # training; every rank gets the same dict; optimizer state in torch's indexing.
        assert list(r["s2"]) == list(plain.state_dict())
        assert_same(r["s2"], ref[1][0], TOL, f"{kind} model@2")
        assert_same(r["s3"], ref[2][0], TOL, f"{kind} model@3")
        assert_same(r["o2"], ref[1][1], TOL, f"{kind} opt@2")
        assert_same(r["o3"], ref[2][1], TOL, f"{kind} opt@3")
        assert r["on_cpu"]
        for other in rs[1:]:
            assert_same(other["s3"], r["s3"], where=f"{kind} model@3 on every rank")
            assert_same(other["o3"], r["o3"], where=f"{kind} opt@3 on every rank")
        if kind == "tied":
            assert "embed.weight" in r["s2"] and "out.weight" in r["s2"]
        else:
            assert "blocks.2.gain" in r["s2"] and "blocks.2.scratch" not in r["s2"]
        # Partial state: marker, degree, rank; the ranks' keys partition the full dict.
        seen = set()
        for rank, x in enumerate(rs):
            l2 = x["l2"]
            assert l2["_smp_is_partial"] is True
            assert l2["_smp_pp_size"] == pp and l2["_smp_pp_rank"] == rank
            keys = {k for k in l2 if not k.startswith("_smp_")}
            assert keys and not (keys & seen), (rank, keys & seen)
            seen |= keys
            for k in keys:
                assert torch.equal(l2[k], r["s2"][k]), k
            lo2 = x["lo2"]
            assert lo2["_smp_is_partial"] is True and lo2["_smp_pp_size"] == pp
            for i, st in lo2["state"].items():
                assert_same(st, r["o2"]["state"][i], where=f"opt state {i}")
        assert seen == set(r["s2"])
        assert sum(len(x["lo2"]["state"]) for x in rs) == len(r["o2"]["state"])
        if kind == "tied":  # the tied weight is held, under both names, by one rank
            holder = [x for x in rs if "embed.weight" in x["l2"]]
            assert len(holder) == 1 and "out.weight" in holder[0]["l2"]
        # Loads: back to step 2 exactly; the replayed step 3 is bit-identical.
        for x in rs:
            assert_same(x["full_reload"], (r["s2"], r["o2"]), where=f"{kind} full reload")
            assert_same(x["partial_reload"], (r["s2"], r["o2"]), where=f"{kind} partial reload")
            assert_same(x["full_reload_step3"], (r["s3"], r["o3"]), REPLAY_TOL, f"{kind} replay")
            assert_same(x["deferred_partial_step3"], (r["s3"], r["o3"]), REPLAY_TOL,
                        f"{kind} deferred partial")
            assert_same(x["deferred_full_step3"], (r["s3"], r["o3"]), REPLAY_TOL,
                        f"{kind} deferred full")
            assert x["hooks_left"] == 0 and x["shared"]
            assert "pipeline_parallel_degree=4" in x["err_pp"] and f"={pp}" in x["err_pp"]
            assert "pipeline_parallel_degree=4" in x["err_opt_pp"]
            assert x["dropped"] in x["err_missing"] and "Missing" in x["err_missing"]
            assert "bogus" in x["err_extra"] and "Unexpected" in x["err_extra"]
            assert x["nonstrict"] is None
            if pp > 1:
                assert "belongs to pp rank" in x["err_rank"]


@pytest.mark.parametrize("pp", [1, 2])
def test_state_dicts_match_single_process_and_reload(pp):
    results = run_ranks(_job, pp, pp, timeout=150)
    _check(results, pp)
