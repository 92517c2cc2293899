"""Tiny Hugging Face causal LMs and a training loop for the tsm.transform tests (fp32, no dropout)."""

from __future__ import annotations

import torch

VOCAB, HIDDEN, SEQ = 128, 32, 16


def make(kind: str, seed: int = 0, **overrides):
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                  num_attention_heads=4, intermediate_size=64, max_position_embeddings=64)
    if kind in ("llama", "mistral", "mixtral"):
        common.update(num_key_value_heads=2, attention_dropout=0.0, tie_word_embeddings=False)
    if kind == "llama":
        cfg = tf.LlamaConfig(**common)
        cls = tf.LlamaForCausalLM
    elif kind == "mistral":
        cfg = tf.MistralConfig(sliding_window=None, **common)
        cls = tf.MistralForCausalLM
    elif kind == "gpt_neox":
        cfg = tf.GPTNeoXConfig(rotary_pct=0.5, use_parallel_residual=True, hidden_dropout=0.0,
                               attention_dropout=0.0, tie_word_embeddings=False, **common)
        cls = tf.GPTNeoXForCausalLM
    elif kind == "mixtral":
        cfg = tf.MixtralConfig(num_local_experts=4, num_experts_per_tok=2, sliding_window=None,
                               **common)
        cls = tf.MixtralForCausalLM
    else:
        raise ValueError(kind)
    for k, v in overrides.items():
        setattr(cfg, k, v)
    cfg._attn_implementation = overrides.pop("attn", "sdpa")
    torch.manual_seed(seed)
    return cls(cfg).float()


def batches(steps: int = 3, batch: int = 4, seq: int = SEQ, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (batch, seq), generator=g) for _ in range(steps)]


def optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0, foreach=False)


def train_reference(kind: str, steps: int = 3, clip=None, batch: int = 4, **overrides):
    """One process, plain HF model, the whole global batch: (state dict, losses, grad norms)."""
    model = make(kind, **overrides)
    opt = optimizer(model)
    losses, norms = [], []
    for x in batches(steps, batch=batch):
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if clip is not None:
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item())
        opt.step()
        losses.append(loss.item())
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return (sd, losses, norms) if clip is not None else (sd, losses)


def train_ranks(model, local, clip_grad_norm_, clip: float, steps: int = 3,
                average_over=all, batch: int = 4) -> tuple:
    """The ranks' side of the equivalence tests: AdamW on each rank's share `local(x)` of every
    global batch, clipping with `clip_grad_norm_(model, clip)`. Per step: the clipped norm, and
    the loss summed over the ranks and divided by `average_over` (the world size by default;
    None: this rank's own loss, not reduced). Returns (losses, norms)."""
    import torch.distributed as dist

    opt = optimizer(model)
    losses, norms = [], []
    for x in batches(steps, batch=batch):
        x = local(x)
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        norms.append(clip_grad_norm_(model, clip).item())
        opt.step()
        if average_over is None:
            losses.append(loss.item())
            continue
        full = loss.detach().clone()
        dist.all_reduce(full)
        losses.append(full.item() / (dist.get_world_size() if average_over is all else average_over))
    return losses, norms


def max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)
