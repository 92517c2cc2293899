"""torch.sagemaker.distributed.checkpoint: a sharded checkpoint written at hybrid_shard_degree 2
(replica 0 writes) loads at degree 4 with its optimizer state; the full export loads into the
plain HF model; an async save holds the weights of the moment it was called; a local (SM_LOCAL)
checkpoint restores; a checkpoint of another model shape is refused on every rank, naming the key."""

import os

import torch

from smshim.testing import run_ranks
from tests import tsm_helpers as h

PROBE = torch.arange(2 * h.SEQ).reshape(2, h.SEQ) % h.VOCAB


def _step(model, opt, x):
    import torch.sagemaker as tsm

    opt.zero_grad()
    xl = h.local_batch(x, tsm.state.dp_rank, tsm.state.dp_size)
    model(input_ids=xl, labels=xl).loss.backward()
    opt.step()


def _logits(model):
    with torch.no_grad():
        return model(input_ids=PROBE).logits.clone()


def _save_at_2(root):
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from torch.sagemaker.distributed.checkpoint import full, state_dict_saver
    from torch.sagemaker.distributed.checkpoint.async_utils import AsyncCallsQueue
    from torch.sagemaker.distributed.checkpoint.state_dict_utils import (SMStateDictType,
                                                                         sm_state_dict_type)
    from torch.sagemaker.utils.process_group_utils import get_global_ranks

    dist.init_process_group("gloo")
    tsm.init({"hybrid_shard_degree": 2})
    rank = dist.get_rank()
    model = h.wrap(h.make_llama())
    opt = torch.optim.AdamW(model.parameters(), lr=h.LR)
    xs = h.batches(5)
    for x in xs[:2]:
        _step(model, opt, x)
    out = {"logits2": _logits(model)}
    coordinator = min(get_global_ranks(model.process_group))
    sd = h.sharded_state_dict(model, opt)
    if tsm.state.ranker.get_rep_rank(rank) == 0:
        state_dict_saver.save(sd, checkpoint_id=os.path.join(root, "sharded", "tp0_ep0"),
                              process_group=model.process_group, coordinator_rank=coordinator)
    full.save_full(model, os.path.join(root, "full"), h.llama_config())

    # Async: the checkpoint holds the weights of the call, though training goes on meanwhile.
    queue = AsyncCallsQueue()
    if tsm.state.ranker.get_rep_rank(rank) == 0:
        state_dict_saver.async_save(h.sharded_state_dict(model), checkpoint_id=os.path.join(root, "async", "tp0_ep0"),
                                    process_group=model.process_group, coordinator_rank=coordinator,
                                    queue=queue)
    _step(model, opt, xs[2])
    out["logits3"] = _logits(model)
    queue.maybe_finalize_async_calls(blocking=True, process_group=model.process_group)
    out["unfinished"] = queue.get_num_unfinalized_calls()

    # Local: each rank's own shards, written over its replication group.
    groups = [dist.new_group(g) for g in tsm.state.ranker.get_rep_groups()]
    mine = next(grp for g, grp in zip(tsm.state.ranker.get_rep_groups(), groups) if rank in g)
    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        local = {"model": model.state_dict()}
    local_dir = os.path.join(root, "local", f"tp0_ep0_fsdp{model.rank}")
    state_dict_saver.async_save(local, checkpoint_id=local_dir, process_group=mine,
                                coordinator_rank=min(get_global_ranks(mine)), queue=queue)
    queue.maybe_finalize_async_calls(blocking=True, process_group=mine)
    _step(model, opt, xs[3])  # move away, then restore the local checkpoint
    from torch.sagemaker.distributed.checkpoint import state_dict_loader

    with sm_state_dict_type(model, SMStateDictType.SM_LOCAL_STATE_DICT):
        back = {"model": model.state_dict()}
        back = {"model": {k: torch.empty_like(v) for k, v in back["model"].items()}}
        state_dict_loader.load(back, checkpoint_id=local_dir, process_group=mine,
                               coordinator_rank=min(get_global_ranks(mine)))
        model.load_state_dict(back["model"])
    out["logits_local"] = _logits(model)
    return out


def _load_at_4(root):
    import torch.distributed as dist
    import torch.sagemaker as tsm
    from torch.distributed.checkpoint.optimizer import load_sharded_optimizer_state_dict
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import StateDictType
    from torch.sagemaker.distributed.checkpoint import state_dict_loader
    from torch.sagemaker.distributed.checkpoint.filesystem import DistributedFileSystemReader
    from torch.sagemaker.utils.process_group_utils import get_global_ranks

    dist.init_process_group("gloo")
    tsm.init({"hybrid_shard_degree": 4})
    out = {}
    for kind in ("sharded", "async"):
        model = h.wrap(h.make_llama(seed=7))  # other weights: the load must replace them
        opt = torch.optim.AdamW(model.parameters(), lr=h.LR)
        path = os.path.join(root, kind, "tp0_ep0")
        coordinator = min(get_global_ranks(model.process_group))
        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            sd = {"model": model.state_dict()}
            state_dict_loader.load(sd, checkpoint_id=path, process_group=model.process_group,
                                   coordinator_rank=coordinator)
            model.load_state_dict(sd["model"])
            if kind == "sharded":
                optim = load_sharded_optimizer_state_dict(
                    model_state_dict=sd["model"], optimizer_key="optimizer",
                    storage_reader=DistributedFileSystemReader(path))
                opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, optim["optimizer"]))
        out[kind] = _logits(model)
        if kind == "sharded":
            _step(model, opt, h.batches(5)[2])  # resumed training continues exactly
            out["sharded_then_step"] = _logits(model)

    # A checkpoint of another model shape: a clear error on every rank.
    from transformers import LlamaForCausalLM

    cfg = h.llama_config()
    cfg.hidden_size, cfg.intermediate_size = 48, 96
    torch.manual_seed(0)
    other = h.wrap(LlamaForCausalLM(cfg))
    try:
        with FSDP.state_dict_type(other, StateDictType.SHARDED_STATE_DICT):
            sd = {"model": other.state_dict()}
            state_dict_loader.load(sd, checkpoint_id=os.path.join(root, "sharded", "tp0_ep0"),
                                   process_group=other.process_group)
        out["wrong_shape"] = None
    except ValueError as e:
        out["wrong_shape"] = str(e)
    dist.barrier()  # every rank is still in step after the refusal
    return out


def test_sharded_full_async_local_checkpoints(tmp_path):
    root = str(tmp_path)
    saved = run_ranks(_save_at_2, 4, root, timeout=300)
    s0 = saved[0]
    assert all(s["unfinished"] == 0 for s in saved)
    for s in saved:
        assert (s["logits_local"] - s["logits3"]).abs().max() < 1e-5
    loaded = run_ranks(_load_at_4, 4, root, timeout=300)
    for r in loaded:
        assert (r["sharded"] - s0["logits2"]).abs().max() < 1e-5
        assert (r["async"] - s0["logits2"]).abs().max() < 1e-5
        assert (r["sharded_then_step"] - s0["logits3"]).abs().max() < 1e-5
        msg = r["wrong_shape"]
        assert msg and "model.model.embed_tokens.weight" in msg and "(100, 32)" in msg \
            and "(100, 48)" in msg, msg
    # The export is an ordinary HF checkpoint.
    from transformers import LlamaForCausalLM

    plain = LlamaForCausalLM.from_pretrained(os.path.join(root, "full"))
    assert (_logits(plain) - s0["logits2"]).abs().max() < 1e-5
