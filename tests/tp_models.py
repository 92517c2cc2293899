"""Small models for the tensor-parallel tests: each distributed model next to a plain torch
module computing the same function, with the same state-dict keys."""

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, SEQ, HIDDEN, HEADS, HEAD_SIZE, INTER = 24, 6, 16, 4, 4, 32


class LinearNet(nn.Module):
    """Embedding (split), a replicated Linear, two Linears (split)."""

    def __init__(self, dist: bool) -> None:
        super().__init__()
        import smdistributed.modelparallel.torch as smp
        Lin = smp.nn.DistributedLinear if dist else nn.Linear
        Emb = smp.nn.DistributedEmbedding if dist else nn.Embedding
        self.emb = Emb(VOCAB, 8)
        self.mix = nn.Linear(8, 8)  # never distributed: replicated, averaged over DP
        self.fc1 = Lin(8, 16)
        self.fc2 = Lin(16, 4)

    def forward(self, ids):
        h = torch.tanh(self.mix(self.emb(ids).mean(dim=1)))
        return self.fc2(torch.relu(self.fc1(h)))


class PlainAttention(nn.Module):
    def __init__(self, pre: bool, post: bool, causal: bool) -> None:
        super().__init__()
        inner = HEADS * HEAD_SIZE
        self.query, self.key, self.value = (nn.Linear(HIDDEN, inner) for _ in range(3))
        self.dense = nn.Linear(inner, HIDDEN)
        self.pre, self.post, self.causal = pre, post, causal
        if pre:
            self.pre_layernorm_module = nn.LayerNorm(HIDDEN)
        if post:
            self.layernorm = nn.LayerNorm(HIDDEN)

    def forward(self, h, mask, cross=None):
        x = self.pre_layernorm_module(h) if self.pre else h
        n, s, _ = x.shape
        kv = x if cross is None else cross

        def heads(t):
            return t.view(n, t.shape[1], HEADS, HEAD_SIZE).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(kv)), heads(self.value(kv))
        bias = mask.expand(n, 1, s, kv.shape[1])
        if self.causal:
            causal = torch.ones(s, s, dtype=torch.bool).tril()
            bias = bias.masked_fill(~causal, torch.finfo(x.dtype).min)
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        out = self.dense(ctx.transpose(1, 2).reshape(n, s, -1)) + h
        return self.layernorm(out) if self.post else out


class PlainOutput(nn.Module):
    def __init__(self, pre: bool, post: bool, act=F.gelu) -> None:
        super().__init__()
        self.act = act
        self.dense_h_to_4h = nn.Linear(HIDDEN, INTER)
        self.dense_4h_to_h = nn.Linear(INTER, HIDDEN)
        self.pre, self.post = pre, post
        if pre:
            self.pre_layernorm_module = nn.LayerNorm(HIDDEN)
        if post:
            self.layernorm = nn.LayerNorm(HIDDEN)

    def forward(self, h):
        x = self.pre_layernorm_module(h) if self.pre else h
        out = self.dense_4h_to_h(self.act(self.dense_h_to_4h(x))) + h
        return self.layernorm(out) if self.post else out


class PlainLayer(nn.Module):
    def __init__(self, pre: bool, post: bool, causal: bool) -> None:
        super().__init__()
        self.attention = PlainAttention(pre, post, causal)
        self.output = PlainOutput(pre, post)

    def forward(self, inputs):
        h, mask = inputs
        return (self.output(self.attention(h, mask)), mask)


class LayerNet(nn.Module):
    """Embedding (plain), two transformer layers, a plain head."""

    def __init__(self, dist: bool, pre: bool = True, post: bool = False,
                 causal: bool = True, n_layers: int = 2) -> None:
        super().__init__()
        import smdistributed.modelparallel.torch as smp
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        if dist:
            def make():
                return smp.nn.DistributedTransformerLayer(
                    num_attention_heads=HEADS, attention_head_size=HEAD_SIZE, hidden_size=HIDDEN,
                    intermediate_size=INTER, attention_dropout_prob=0.0, hidden_dropout_prob=0.0,
                    causal_mask_size=SEQ if causal else None, pre_layernorm=pre,
                    post_layernorm=post)
        else:
            def make():
                return PlainLayer(pre, post, causal)
        self.layers = nn.ModuleList([make() for _ in range(n_layers)])
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        mask = torch.zeros(ids.shape[0], 1, 1, ids.shape[1])
        mask[:, :, :, 0] = -1e4  # the first position is masked out (an additive mask)
        for layer in self.layers:
            h = layer((h, mask))[0]
        return self.head(h)


def data(kind, steps, batch, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        if kind.startswith("linear"):
            y = torch.randn(batch, 4, generator=g)
        else:
            y = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        out.append((ids, y))
    return out


def loss_fn(kind, out, y):
    if kind.startswith("linear"):
        return F.mse_loss(out, y)
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


class GPT2(nn.Module):
    """A tiny Hugging Face GPT-2 LM (built from a config, nothing downloaded) returning logits."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel
        cfg = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=2,
                         n_head=HEADS, n_inner=INTER, resid_pdrop=0.0, embd_pdrop=0.0,
                         attn_pdrop=0.0, use_cache=False)
        self.lm = GPT2LMHeadModel(cfg)

    def forward(self, ids):
        return self.lm(input_ids=ids).logits


class LMHeadNet(nn.Module):
    """smp.nn.DistributedTransformerLMHead (pre- and post-layernorm, causal, token types, tied
    head). Its unsplit reference is the same class built where tensor_parallel_degree is 1 (the
    single test process): same seed, same full tensors, no collectives."""

    def __init__(self) -> None:
        super().__init__()
        import smdistributed.modelparallel.torch as smp
        self.lm = smp.nn.DistributedTransformerLMHead(
            num_layers=2, num_attention_heads=HEADS, attention_head_size=HEAD_SIZE,
            hidden_size=HIDDEN, intermediate_size=INTER, vocab_size=VOCAB, num_positions=SEQ,
            attention_dropout_prob=0.0, hidden_dropout_prob=0.0, num_token_types=2,
            causal_mask_size=SEQ, pre_layernorm=True, post_layernorm=True)

    def forward(self, ids):
        types = (ids % 2).long()
        mask = torch.zeros_like(ids)
        mask[:, 0] = 1  # the first position is masked (1 = masked)
        return self.lm((ids, mask, types, None, None))


class PlainCrossLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = PlainAttention(False, True, False)
        self.cross_attention = PlainAttention(False, True, False)
        self.output = PlainOutput(False, True, act=F.relu)

    def forward(self, inputs):
        h, cross, mask, cross_mask = inputs
        h = self.cross_attention(self.attention(h, mask), cross_mask, cross)
        return (self.output(h),) + tuple(inputs[1:])


class CrossNet(nn.Module):
    """A DistributedTransformerLayer with cross attention (post-layernorm, relu) next to a plain
    implementation."""

    def __init__(self, dist: bool) -> None:
        super().__init__()
        import smdistributed.modelparallel.torch as smp
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        if dist:
            self.layer = smp.nn.DistributedTransformerLayer(
                num_attention_heads=HEADS, attention_head_size=HEAD_SIZE, hidden_size=HIDDEN,
                intermediate_size=INTER, attention_dropout_prob=0.0, hidden_dropout_prob=0.0,
                activation="relu", add_cross_attention=True)
        else:
            self.layer = PlainCrossLayer()
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        h = self.emb(ids)
        cross = self.emb(ids.flip(1)) * 0.5
        mask = torch.zeros(ids.shape[0], 1, 1, ids.shape[1])
        cross_mask = mask.clone()
        cross_mask[:, :, :, -1] = -1e4
        return self.head(self.layer((h, cross, mask, cross_mask))[0])


def make(kind, dist):
    torch.manual_seed(0)
    if kind == "linear":
        return LinearNet(dist)
    if kind == "linear_auto":
        return LinearNet(False)
    if kind == "gpt2":
        return GPT2()
    if kind == "gpt_neox":
        return GPTNeoX()
    if kind == "gpt_neox_sdpa":
        return GPTNeoX(attn="sdpa")
    if kind == "bert":
        return Bert()
    if kind == "cross":
        return CrossNet(dist)
    if kind == "lmhead":
        return LMHeadNet()
    if kind == "layer3":
        return LayerNet(dist, n_layers=3)
    if kind == "layer_post":
        return LayerNet(dist, pre=False, post=True, causal=False)
    return LayerNet(dist)


def reference(kind, steps=3, batch=8, lr=0.1, with_optimizer=False):
    """Single-process training: the model's state dict (and the optimizer's)."""
    model = make(kind, dist=False)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for ids, y in data(kind, steps, batch):
        opt.zero_grad()
        loss_fn(kind, model(ids), y).backward()
        opt.step()
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return (sd, opt.state_dict()) if with_optimizer else sd


def _mlp_init_hook(d, h):
    return (), dict(hidden_size=d, intermediate_size=h, hidden_dropout_prob=0.0,
                    pre_layernorm=True, post_layernorm=False)


def _mlp_forward_hook(x, scale=1.0):
    return (x * scale,), {}


def registered_mlp_class():
    """A user MLP registered (decorator form) to become a DistributedTransformerOutputLayer."""
    import smdistributed.modelparallel.torch as smp

    @smp.tp_register(smp.nn.DistributedTransformerOutputLayer, init_hook=_mlp_init_hook,
                     forward_hook=_mlp_forward_hook, return_hook=lambda out: out * 2)
    class MyMLP(nn.Module):
        def __init__(self, d, h):
            super().__init__()
            self.ln = nn.LayerNorm(d)
            self.up, self.down = nn.Linear(d, h), nn.Linear(h, d)

        def forward(self, x, scale=1.0):
            x = x * scale
            return 2 * (self.down(F.gelu(self.up(self.ln(x)))) + x)

    return MyMLP


class GPTNeoX(nn.Module):
    """A tiny Hugging Face GPT-NeoX LM (from a config, nothing downloaded) returning logits: eager
    attention, rotary embeddings on half of each head, block 0 with the parallel residual and
    block 1 with the sequential one, per-example position ids (so the rotary (cos, sin) pair is
    per example too). `heads` other than HEADS builds the non-divisible variant; attn="sdpa" the
    sdpa variant with (right) padding in some examples. Std 0.3 as in Bert below."""

    def __init__(self, heads: int = HEADS, attn: str = "eager") -> None:
        super().__init__()
        from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
        self.pad = attn == "sdpa"
        cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=HIDDEN // HEADS * heads,
                            num_hidden_layers=2, num_attention_heads=heads,
                            intermediate_size=INTER, max_position_embeddings=2 * SEQ,
                            hidden_dropout=0.0, attention_dropout=0.0, use_cache=False,
                            rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                             "partial_rotary_factor": 0.5},
                            use_parallel_residual=True, tie_word_embeddings=False,
                            attn_implementation=attn, initializer_range=0.3)
        self.lm = GPTNeoXForCausalLM(cfg)
        self.lm.gpt_neox.layers[1].use_parallel_residual = False

    def forward(self, ids):
        pos = torch.arange(ids.shape[1]).unsqueeze(0) + (ids[:, :1] % 2)
        mask = None
        if self.pad:
            # sdpa: a microbatch without padding gets no mask (causal), one with padding a
            # per-example mask; the TP ranks' microbatches differ in that.
            mask = torch.ones_like(ids)
            mask[:, -1] = (ids[:, 0] % 2)  # odd first ids: the last position is padding
        return self.lm(input_ids=ids, position_ids=pos, attention_mask=mask).logits


class Bert(nn.Module):
    """A tiny Hugging Face BERT masked LM (from a config, nothing downloaded) returning logits:
    sdpa attention, token types, and a padding mask that differs per example (so the attention
    mask is per example and gathered with the batch). Initialised with std 0.3 instead of 0.02:
    attention scores of order 1 instead of 1e-3, so a wrong pairing of heads changes the result
    well beyond the tolerance."""

    def __init__(self, intermediate: int = INTER) -> None:
        super().__init__()
        from transformers import BertConfig, BertForMaskedLM
        cfg = BertConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2,
                         num_attention_heads=HEADS, intermediate_size=intermediate,
                         max_position_embeddings=SEQ, hidden_dropout_prob=0.0,
                         attention_probs_dropout_prob=0.0, attn_implementation="sdpa",
                         initializer_range=0.3)
        self.lm = BertForMaskedLM(cfg)

    def forward(self, ids):
        mask = torch.ones_like(ids)
        mask[:, -1] = (ids[:, 0] % 2)  # odd first ids: the last position is padding
        types = (ids % 2).long()
        return self.lm(input_ids=ids, attention_mask=mask, token_type_ids=types).logits
