"""Tensor parallelism (smp.nn, set_tensor_parallelism) trains exactly like single-process
training of the unsplit model: 3 steps, parameters within 1e-5."""

import time

import pytest
import torch

from smshim.testing import run_ranks
from tests import tp_models

TOL = 1e-5


def _train(kind, cfg, auto=False, ckpt_dir=None, manual=None, delay=0.0, steps=3, batch=8):
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    if auto == "context":
        # Created inside the context; one submodule opted out afterwards.
        with smp.model_creation(tensor_parallelism=True):
            module = tp_models.make(kind, dist=True)
        smp.set_tensor_parallelism(module.mix, enabled=False)
    elif auto:
        module = tp_models.make(kind, dist=True)
        smp.set_tensor_parallelism(module)
    else:
        module = tp_models.make(kind, dist=True)
        # The plain model's weights (same seed) load into the split one: each rank keeps its
        # shard.
        module.load_state_dict(tp_models.make(kind, dist=False).state_dict())
    model = smp.DistributedModel(module)
    per_rank = sum(p.numel() for p in model.module.parameters())
    distributed = sorted(type(m).__name__ for m in model.module.modules()
                         if isinstance(m, smp.nn.DistributedModule))
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for name, pid in (manual or {}).items():
        smp.set_partition(module.get_submodule(name), pid)

    @smp.step
    def train_step(model, ids, y):
        loss = tp_models.loss_fn(kind, model(ids), y)
        if delay and smp.tp_rank() == 1 and smp.state.microbatch % 2 == 0:
            # TP rank 1's pipeline asks for even microbatches' backward late: the other
            # stage's TP pair then runs its requests in different orders.
            time.sleep(delay)
        model.backward(loss)
        return loss

    # prescaled_batch: the TP ranks of a group share one batch (sharded by rdp_rank); else each
    # rank of the DP group (rdp x tp ranks) has its own.
    n, r = (smp.rdp_size(), smp.rdp_rank()) if cfg.get("prescaled_batch") else \
        (smp.dp_size(), smp.dp_rank())
    k = batch // n
    for ids, y in tp_models.data(kind, steps, batch):
        opt.zero_grad()
        train_step(model, ids[r * k:(r + 1) * k], y[r * k:(r + 1) * k])
        opt.step()
    full = model.state_dict() if smp.rdp_rank() == 0 else None
    if ckpt_dir is not None:
        smp.save_checkpoint(ckpt_dir, "tp", partial=False, model=model, optimizer=opt)
    local = sum(p.numel() for p in model.local_parameters())
    import torch.distributed as dist
    groups = {"tp": smp.get_tp_group(), "rdp": smp.get_rdp_group(), "dp": smp.get_dp_group(),
              "tp_size": smp.tp_size(), "rdp_rank": smp.rdp_rank(), "rdp_size": smp.rdp_size(),
              "tp_pg_rank": dist.get_rank(smp.get_tp_process_group()),
              "rdp_pg_rank": dist.get_rank(smp.get_rdp_process_group())}
    return {"full": full, "per_rank": per_rank, "local": local, "rank": smp.rank(),
            "tp_rank": smp.tp_rank(), "distributed": distributed, "groups": groups}


def _check(results, kind):
    ref = tp_models.reference(kind)
    checked = 0
    for r in results:
        if r["full"] is None:
            continue
        assert set(r["full"]) == set(ref)
        for k, v in ref.items():
            assert r["full"][k].shape == v.shape, (k, r["full"][k].shape, v.shape)
            diff = (r["full"][k] - v).abs().max().item()
            assert diff < TOL, f"rank {r['rank']}: {k}: max abs diff {diff}"
        checked += 1
    assert checked


@pytest.mark.parametrize("prescaled", [False, True])
def test_linear_embedding_tp2(prescaled):
    cfg = {"tensor_parallel_degree": 2, "microbatches": 2, "prescaled_batch": prescaled}
    results = run_ranks(_train, 2, "linear", cfg, timeout=120)
    _check(results, "linear")
    full = sum(v.numel() for v in tp_models.make("linear", dist=False).parameters())
    assert all(r["per_rank"] < full for r in results)


def test_transformer_layer_tp2_vs_plain_layer():
    """DistributedTransformerLayer (pre-layernorm, causal; and post-layernorm) trains as an
    independent plain implementation of the same layer."""
    for kind in ("layer", "layer_post"):
        results = run_ranks(_train, 2, kind, {"tensor_parallel_degree": 2}, timeout=120)
        _check(results, kind)


def test_transformer_lm_head_tp2_vs_unsplit():
    """DistributedTransformerLMHead (embeddings split over hidden, tied head, a
    DistributedTransformer with input/output layernorms) at tp=2 trains as the same module
    unsplit."""
    results = run_ranks(_train, 2, "lmhead", {"tensor_parallel_degree": 2}, timeout=120)
    _check(results, "lmhead")


def test_cross_attention_layer_tp2_vs_unsplit():
    results = run_ranks(_train, 2, "cross", {"tensor_parallel_degree": 2, "microbatches": 2},
                        timeout=120)
    _check(results, "cross")


def test_set_tensor_parallelism_linear_embedding():
    results = run_ranks(_train, 2, "linear_auto", {"tensor_parallel_degree": 2}, True,
                        timeout=120)
    assert results[0]["distributed"] == ["DistributedEmbedding", "DistributedLinear",
                                         "DistributedLinear", "DistributedLinear"]
    _check(results, "linear_auto")


def test_model_creation_context_and_opt_out():
    results = run_ranks(_train, 2, "linear_auto", {"tensor_parallel_degree": 2}, "context",
                        timeout=120)
    assert results[0]["distributed"] == ["DistributedEmbedding", "DistributedLinear",
                                         "DistributedLinear"]  # `mix` opted out
    _check(results, "linear_auto")


def test_set_tensor_parallelism_hf_gpt2_tp2():
    results = run_ranks(_train, 2, "gpt2", {"tensor_parallel_degree": 2, "microbatches": 2},
                        True, timeout=180)
    # The blocks' projections and the position embedding are split; the word embedding is tied
    # to the LM head, so both stay whole.
    assert results[0]["distributed"].count("ShardedConv1D") == 8
    assert results[0]["distributed"].count("DistributedEmbedding") == 1
    assert "DistributedLinear" not in results[0]["distributed"]
    _check(results, "gpt2")


def test_set_tensor_parallelism_hf_gpt2_pp2_tp2():
    """The GPT-2 blocks split in place also run as remote modules of a 2-stage pipeline."""
    cfg = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2}
    results = run_ranks(_train, 4, "gpt2", cfg, True, timeout=240)
    _check(results, "gpt2")


@pytest.mark.parametrize("prescaled", [False, True])
def test_tp2_dp2(prescaled):
    cfg = {"tensor_parallel_degree": 2, "ddp": True, "microbatches": 2,
           "prescaled_batch": prescaled}
    results = run_ranks(_train, 4, "layer", cfg, timeout=180)
    _check(results, "layer")
    # Placement "cluster" (DPT): ranks 2d + t; TP pairs {0,1}, {2,3}; RDP pairs {0,2}, {1,3}.
    for r in results:
        g, rank = r["groups"], r["rank"]
        assert g["tp"] == [rank - rank % 2, rank - rank % 2 + 1] and g["tp_size"] == 2
        assert g["rdp"] == [rank % 2, rank % 2 + 2] and g["rdp_size"] == 2
        assert g["dp"] == [0, 1, 2, 3]
        assert r["tp_rank"] == g["tp_pg_rank"] == rank % 2
        assert g["rdp_rank"] == g["rdp_pg_rank"] == rank // 2


PP_TP = [
    ("manual-2mb", {"microbatches": 2, "auto_partition": False, "default_partition": 0},
     {"layers.1": 1, "head": 1}, 0.0),
    ("manual-4mb-simple", {"microbatches": 4, "pipeline": "simple", "auto_partition": False,
                           "default_partition": 0}, {"layers.0": 1, "head": 1}, 0.0),
    ("auto-4mb", {"microbatches": 4}, None, 0.0),
    # TP rank 1 delays its even microbatches' backward, so stage 1's two TP ranks serve
    # forwards and backwards in different orders (one shared TP group would pair the wrong
    # collectives here).
    ("manual-4mb-skewed", {"microbatches": 4, "auto_partition": False,
                           "default_partition": 0}, {"layers.1": 1}, 0.3),
]


@pytest.mark.parametrize("case, cfg, manual, delay", PP_TP, ids=[c[0] for c in PP_TP])
def test_pp2_tp2(case, cfg, manual, delay):
    """Pipeline x tensor parallel (4 processes): several microbatches in flight, each stage's TP
    pair running them concurrently, possibly in different orders."""
    cfg = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, **cfg}
    # Three layers: with the middle one on stage 1, stage 0 runs TP layers both before and after
    # the remote call, so its microbatches' TP work interleaves.
    results = run_ranks(_train, 4, "layer3", cfg, False, None, manual, delay, timeout=240)
    _check(results, "layer3")
    # Each rank holds only its stage's shards.
    full = sum(v.numel() for v in tp_models.make("layer3", dist=False).parameters())
    assert all(r["local"] < full * 3 / 4 for r in results), [r["local"] for r in results]


def test_full_checkpoint_pp2_tp2_loads_into_plain_model(tmp_path):
    cfg = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2,
           "auto_partition": False, "default_partition": 0}
    run_ranks(_train, 4, "layer", cfg, False, str(tmp_path), {"layers.1": 1, "head": 1},
              timeout=240)
    sd = torch.load(tmp_path / "tp", weights_only=True)
    plain = tp_models.make("layer", dist=False)
    plain.load_state_dict(sd)  # strict: exactly the plain module's keys and shapes
    ref_sd, ref_opt = tp_models.reference("layer", with_optimizer=True)
    trained = tp_models.make("layer", dist=False)
    trained.load_state_dict(ref_sd)
    # The full optimizer state gathers the shards' momentum buffers too, in torch's indexing.
    osd = torch.load(tmp_path / "tp_optimizer.pt", weights_only=True)
    assert set(osd["state"]) == set(ref_opt["state"])
    for i, entry in ref_opt["state"].items():
        got = osd["state"][i]["momentum_buffer"]
        assert got.shape == entry["momentum_buffer"].shape, i
        assert (got - entry["momentum_buffer"]).abs().max().item() < TOL, i
    ids = tp_models.data("layer", 1, 8, seed=11)[0][0]
    with torch.no_grad():
        diff = (plain(ids) - trained(ids)).abs().max().item()
    assert diff < TOL, diff


def _registered(cfg):
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    MyMLP = tp_models.registered_mlp_class()
    torch.manual_seed(0)
    root = torch.nn.Sequential(MyMLP(tp_models.HIDDEN, tp_models.INTER))
    smp.set_tensor_parallelism(root)
    model = smp.DistributedModel(root)
    x = torch.randn(4, tp_models.SEQ, tp_models.HIDDEN, generator=torch.Generator().manual_seed(5))

    @smp.step
    def fwd(model, x):
        # A keyword argument reaches the forward_hook (Sequential would not pass it on).
        return model.module[0](x, scale=0.5)

    out = fwd(model, x).concat()
    return {"type": type(model.module[0]).__name__, "out": out, "full": model.state_dict()}


def test_tp_register_hooks():
    """A registered user class is rebuilt as its distributed module (init_hook maps the
    constructor arguments), called through forward_hook and return_hook, and computes what the
    unsplit distributed module computes with the same (gathered) weights."""
    import smdistributed.modelparallel.torch as smp

    results = run_ranks(_registered, 2, {"tensor_parallel_degree": 2, "prescaled_batch": True},
                        timeout=120)
    assert results[0]["type"] == "DistributedTransformerOutputLayer"
    args, kwargs = tp_models._mlp_init_hook(tp_models.HIDDEN, tp_models.INTER)
    plain = smp.nn.DistributedTransformerOutputLayer(*args, **kwargs)  # unsplit: tp is 1 here
    plain.load_state_dict({k[2:]: v for k, v in results[0]["full"].items()})  # drop "0."
    x = torch.randn(4, tp_models.SEQ, tp_models.HIDDEN, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want = plain(x * 0.5) * 2
    for r in results:
        assert (r["out"] - want).abs().max().item() < TOL


def _partial_roundtrip(cfg):
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    model = smp.DistributedModel(tp_models.make("layer", dist=True))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    lsd = {k: (v.clone() if isinstance(v, torch.Tensor) else v)
           for k, v in model.local_state_dict().items()}
    with torch.no_grad():
        for p in model.module.parameters():
            p.zero_()
    model.load_state_dict(lsd)  # this rank's shards back
    full = model.state_dict()
    wrong = dict(lsd)
    wrong["_smp_tp_rank"] = 1 - smp.tp_rank()
    try:
        model.load_state_dict(wrong)
        error = None
    except smp.SMPValidationError as e:
        error = str(e)
    return {"full": full, "before": before, "error": error,
            "tp_meta": (lsd["_smp_tp_size"], lsd["_smp_tp_rank"])}


def test_partial_state_dict_roundtrip_tp2():
    """A partial (local) state dict holds this rank's shards and says which; it loads back on the
    same tp rank and is refused, naming both tp ranks, on another."""
    results = run_ranks(_partial_roundtrip, 2, {"tensor_parallel_degree": 2}, timeout=120)
    plain_keys = set(tp_models.make("layer", dist=False).state_dict())
    for t, r in enumerate(results):
        assert r["tp_meta"] == (2, t)
        assert set(r["full"]) == plain_keys
        assert sum(v.abs().sum() for v in r["before"].values()) > 0
        for k, v in r["before"].items():
            assert torch.equal(r["full"][k], v), k
        assert r["error"] is not None and f"tp rank {1 - t}" in r["error"], r["error"]


def _which_distributed(cfg):
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    torch.manual_seed(0)
    emb = torch.nn.Embedding(10, 8)
    head = torch.nn.Linear(8, 10, bias=False)
    head.weight = emb.weight  # tied: both stay whole
    root = torch.nn.ModuleDict({
        "odd": torch.nn.Linear(8, 5),  # 5 output features do not split in 2: stays whole
        "even": torch.nn.Linear(8, 6),
        "emb": emb, "head": head,
        "outer": torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sequential(
            torch.nn.Linear(4, 4))),
    })
    smp.set_tensor_parallelism(root)
    smp.set_tensor_parallelism(root["outer"][1], enabled=False)
    model = smp.DistributedModel(root)
    return {n: type(m).__name__ for n, m in model.module.named_modules() if n}


def test_which_modules_are_distributed():
    types = run_ranks(_which_distributed, 2, {"tensor_parallel_degree": 2}, timeout=120)[0]
    assert types["odd"] == "Linear" and types["even"] == "DistributedLinear"
    assert types["emb"] == "Embedding" and types["head"] == "Linear"
    assert types["outer.0"] == "DistributedLinear" and types["outer.1.0"] == "Linear"


def test_fused_layer_norm_is_a_layernorm():
    from smdistributed.modelparallel.torch.nn import FusedLayerNorm

    ln = FusedLayerNorm(8, eps=1e-6)
    assert isinstance(ln, torch.nn.LayerNorm) and ln.eps == 1e-6


def _train_clipped(kind, cfg, manual, max_norm, steps=3, batch=8):
    import smdistributed.modelparallel.torch as smp

    smp.init(cfg)
    module = tp_models.make(kind, dist=True)
    module.load_state_dict(tp_models.make(kind, dist=False).state_dict())
    model = smp.DistributedModel(module)
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    for name, pid in manual.items():
        smp.set_partition(module.get_submodule(name), pid)

    @smp.step
    def train_step(model, ids, y):
        loss = tp_models.loss_fn(kind, model(ids), y)
        model.backward(loss)
        return loss

    norms = []
    for ids, y in tp_models.data(kind, steps, batch):
        opt.zero_grad()
        train_step(model, ids, y)
        norms.append(opt.clip_master_grads(max_norm))
        opt.step()
    full = model.state_dict() if smp.rdp_rank() == 0 else None
    return {"full": full, "norms": norms, "rank": smp.rank()}


def test_clip_master_grads_pp2_tp2_equals_clip_grad_norm():
    """The global norm counts every shard once and every replicated parameter once, over both
    stages and both TP ranks: the norm torch computes on the unsplit single-process model."""
    cfg = {"pipeline_parallel_degree": 2, "tensor_parallel_degree": 2, "microbatches": 2,
           "prescaled_batch": True, "auto_partition": False, "default_partition": 0}
    max_norm = 0.05
    results = run_ranks(_train_clipped, 4, "layer", cfg, {"layers.1": 1, "head": 1}, max_norm,
                        timeout=240)
    model = tp_models.make("layer", dist=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    want = []
    for ids, y in tp_models.data("layer", 3, 8):
        opt.zero_grad()
        tp_models.loss_fn("layer", model(ids), y).backward()
        want.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
    assert min(want) > max_norm  # clipping happened at every step
    for r in results:
        assert len(r["norms"]) == 3
        for got, w in zip(r["norms"], want):
            assert abs(got - w) <= 1e-5 * w, (r["rank"], r["norms"], want)
    ref = model.state_dict()
    full = next(r["full"] for r in results if r["full"] is not None)
    for k, v in ref.items():
        assert (full[k] - v).abs().max().item() < TOL, k
