"""State-dict layouts of the Hugging Face models smp replaces (GPT-2, BERT, RoBERTa, GPT-J,
GPT-Neo, SPEC §7.6), and the exact translation between a model's Hugging Face state dict and smp's.

smp's layout is the state dict of smp's distributed transformer (`DistributedTransformerLMHead`
and family: `word_embedding`, `position_embedding`, `transformer.seq_layers.<i>.attention.{query,
key,value,dense}`, `...output.{dense_h_to_4h,dense_4h_to_h}`, layernorms). Its names are not
public (SPEC §7.6), so they are ours; what matters is that both directions are exact inverses:
every tensor is moved, transposed (Conv1D weights are [in, out], Linear weights [out, in]) or cut
into / glued from equal thirds (GPT-2's fused q/k/v projection), all bit-exact operations. Keys a
layout has no rule for (task heads such as BERT's `cls.*`, buffers of old checkpoints) pass through
unchanged in both directions.

A state dict of the bare transformer (GPT2Model, BertModel, ...: no `transformer.` / `bert.` /
`roberta.` prefix) is accepted and read as the model's; translating back to Hugging Face gives the
task model's layout (the class smp replaces: GPT2LMHeadModel, BertForMaskedLM, ...).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch

__all__ = ["Rule", "Layout", "LAYOUTS", "hf_to_smp", "smp_to_hf", "prefixed"]

# How a value changes from the Hugging Face key to the smp key(s).
SAME, TRANSPOSE, SPLIT3_T, SPLIT3 = "same", "t", "split3_t", "split3"


@dataclass(frozen=True)
class Rule:
    """One Hugging Face key and the smp key(s) it becomes; `{i}` stands for a layer index."""
    hf: str
    smp: Tuple[str, ...]
    kind: str = SAME


@dataclass
class Layout:
    family: str
    base: str                        # the transformer's prefix in the task model ("bert.")
    rules: List[Rule]
    # Buffers old transformers versions saved (causal masks): dropped on the way in, rebuilt
    # with max_seq_len on the way out. Suffixes of the per-layer key.
    causal_buffers: Tuple[str, ...] = ()
    layer_prefix: str = ""           # the HF prefix of layer i, e.g. "transformer.h.{i}."
    _compiled: Optional[List[Tuple["re.Pattern[str]", List["re.Pattern[str]"], Rule]]] = \
        field(default=None, repr=False)

    def compiled(self):
        if self._compiled is None:
            self._compiled = [(_pattern(r.hf), [_pattern(s) for s in r.smp], r) for r in self.rules]
        return self._compiled


def _pattern(template: str) -> "re.Pattern[str]":
    return re.compile("^" + re.escape(template).replace(r"\{i\}", r"(\d+)") + "$")


def _pair(hf: str, smp: str, names: Tuple[str, ...] = ("weight", "bias"),
          kind: str = SAME) -> List[Rule]:
    return [Rule(f"{hf}.{n}", (f"{smp}.{n}",), kind if n == "weight" else SAME) for n in names]


_L = "transformer.seq_layers.{i}."


def _gpt2() -> Layout:
    h = "transformer.h.{i}."
    qkv = tuple(f"{_L}attention.{n}" for n in ("query", "key", "value"))
    rules = [Rule("transformer.wte.weight", ("word_embedding.weight",)),
             Rule("transformer.wpe.weight", ("position_embedding.weight",)),
             *_pair("transformer.ln_f", "final_layernorm"),
             Rule("lm_head.weight", ("lm_head.weight",)),
             *_pair(h + "ln_1", _L + "attention.pre_layernorm_module"),
             Rule(h + "attn.c_attn.weight", tuple(q + ".weight" for q in qkv), SPLIT3_T),
             Rule(h + "attn.c_attn.bias", tuple(q + ".bias" for q in qkv), SPLIT3),
             *_pair(h + "attn.c_proj", _L + "attention.dense", kind=TRANSPOSE),
             *_pair(h + "ln_2", _L + "output.pre_layernorm_module"),
             *_pair(h + "mlp.c_fc", _L + "output.dense_h_to_4h", kind=TRANSPOSE),
             *_pair(h + "mlp.c_proj", _L + "output.dense_4h_to_h", kind=TRANSPOSE)]
    return Layout("gpt2", "transformer.", rules, ("attn.bias", "attn.masked_bias"), h)


def _gptneo() -> Layout:
    h = "transformer.h.{i}."
    a = h + "attn.attention."
    rules = [Rule("transformer.wte.weight", ("word_embedding.weight",)),
             Rule("transformer.wpe.weight", ("position_embedding.weight",)),
             *_pair("transformer.ln_f", "final_layernorm"),
             Rule("lm_head.weight", ("lm_head.weight",)),
             *_pair(h + "ln_1", _L + "attention.pre_layernorm_module"),
             *[Rule(f"{a}{p}_proj.weight", (f"{_L}attention.{n}.weight",))
               for p, n in (("q", "query"), ("k", "key"), ("v", "value"))],
             *_pair(a + "out_proj", _L + "attention.dense"),
             *_pair(h + "ln_2", _L + "output.pre_layernorm_module"),
             *_pair(h + "mlp.c_fc", _L + "output.dense_h_to_4h"),
             *_pair(h + "mlp.c_proj", _L + "output.dense_4h_to_h")]
    return Layout("gptneo", "transformer.", rules, ("attn.attention.bias",
                                                     "attn.attention.masked_bias"), h)


def _gptj() -> Layout:
    h = "transformer.h.{i}."
    # GPT-J's attention and MLP both read ln_1's output (parallel residual): one layernorm.
    rules = [Rule("transformer.wte.weight", ("word_embedding.weight",)),
             *_pair("transformer.ln_f", "final_layernorm"),
             *_pair("lm_head", "lm_head"),
             *_pair(h + "ln_1", _L + "attention.pre_layernorm_module"),
             *[Rule(f"{h}attn.{p}_proj.weight", (f"{_L}attention.{n}.weight",))
               for p, n in (("q", "query"), ("k", "key"), ("v", "value"), ("out", "dense"))],
             *_pair(h + "mlp.fc_in", _L + "output.dense_h_to_4h"),
             *_pair(h + "mlp.fc_out", _L + "output.dense_4h_to_h")]
    return Layout("gptj", "transformer.", rules, ("attn.bias", "attn.masked_bias"), h)


def _bert_like(family: str, base: str) -> Layout:
    e, h = base + "embeddings.", base + "encoder.layer.{i}."
    rules = [Rule(e + "word_embeddings.weight", ("word_embedding.weight",)),
             Rule(e + "position_embeddings.weight", ("position_embedding.weight",)),
             Rule(e + "token_type_embeddings.weight", ("token_type_embedding.weight",)),
             *_pair(e + "LayerNorm", "embedding_layernorm"),
             *[r for n in ("query", "key", "value")
               for r in _pair(f"{h}attention.self.{n}", f"{_L}attention.{n}")],
             *_pair(h + "attention.output.dense", _L + "attention.dense"),
             *_pair(h + "attention.output.LayerNorm", _L + "attention.layernorm"),
             *_pair(h + "intermediate.dense", _L + "output.dense_h_to_4h"),
             *_pair(h + "output.dense", _L + "output.dense_4h_to_h"),
             *_pair(h + "output.LayerNorm", _L + "output.layernorm"),
             *_pair(base + "pooler.dense", "pooler.dense")]
    return Layout(family, base, rules, (), h)


LAYOUTS: Dict[str, Layout] = {
    "gpt2": _gpt2(), "gptneo": _gptneo(), "gptj": _gptj(),
    "bert": _bert_like("bert", "bert."), "roberta": _bert_like("roberta", "roberta."),
}


# ---- the translation -----------------------------------------------------------------------
def _check_mapping(family: str, sd: Any) -> None:
    if not isinstance(sd, dict):
        raise TypeError(f"translating a {family} state dict: expected a dict of tensors, got "
                        f"{type(sd).__name__}")


def _with_base(layout: Layout, sd: Dict[str, Any]) -> Dict[str, Any]:
    """A bare transformer's state dict (no key under the task model's prefix) read as the task
    model's."""
    if not sd or any(k.startswith(layout.base) for k in sd):
        return sd
    return {layout.base + k: v for k, v in sd.items()}


def _put(out: Dict[str, Any], key: str, value: Any, family: str, source: str) -> None:
    if key in out:
        raise ValueError(f"translating a {family} state dict: {source!r} maps onto {key!r}, "
                         "which another key already produced; is this a state dict of the "
                         f"{family} family in the expected layout?")
    out[key] = value


def _is_causal_buffer(layout: Layout, key: str) -> bool:
    layer = re.escape(layout.layer_prefix).replace(r"\{i\}", r"\d+")
    return any(re.fullmatch(layer + re.escape(s), key) for s in layout.causal_buffers)


def hf_to_smp(family: str, sd: Dict[str, Any]) -> Dict[str, Any]:
    """A Hugging Face state dict of `family` in smp's layout (see the module docstring)."""
    layout = LAYOUTS[family]
    _check_mapping(family, sd)
    sd = _with_base(layout, sd)
    out: Dict[str, Any] = {}
    for key, value in sd.items():
        if _is_causal_buffer(layout, key):
            continue  # rebuilt from max_seq_len on the way back
        for hf_re, _, rule in layout.compiled():
            m = hf_re.match(key)
            if m is None:
                continue
            names = [s.replace("{i}", m.group(1)) if m.groups() else s for s in rule.smp]
            for name, v in zip(names, _forward(rule.kind, value, key, family)):
                _put(out, name, v, family, key)
            break
        else:
            _put(out, key, value, family, key)
    return out


def smp_to_hf(family: str, sd: Dict[str, Any], max_seq_len: Optional[int] = None
              ) -> Dict[str, Any]:
    """smp's state dict of `family` in the Hugging Face task model's layout; `max_seq_len`
    adds the causal-mask buffers older transformers versions keep in their state dicts."""
    layout = LAYOUTS[family]
    _check_mapping(family, sd)
    if max_seq_len is not None and (not isinstance(max_seq_len, int) or max_seq_len < 1):
        raise ValueError(f"translate_state_dict_to_hf_{family}: max_seq_len={max_seq_len!r} "
                         "must be a positive int (the model's maximum sequence length) or None")
    out: Dict[str, Any] = {}
    # fused keys waiting for their parts: (rule, hf key, layer index) -> {part: tensor}
    parts: Dict[Tuple[int, str, Optional[str]], Dict[int, Any]] = {}
    layers = set()
    for key, value in sd.items():
        for r_index, (_, smp_res, rule) in enumerate(layout.compiled()):
            hit = next(((j, m) for j, rx in enumerate(smp_res) for m in [rx.match(key)] if m),
                       None)
            if hit is None:
                continue
            j, m = hit
            index = m.group(1) if m.groups() else None
            if index is not None:
                layers.add(int(index))
            hf_key = rule.hf.replace("{i}", index) if index is not None else rule.hf
            if len(rule.smp) == 1:
                _put(out, hf_key, _backward(rule.kind, [value]), family, key)
            else:
                parts.setdefault((r_index, hf_key, index), {})[j] = value
            break
        else:
            _put(out, key, value, family, key)
    for (r_index, hf_key, index), got in parts.items():
        rule = layout.rules[r_index]
        if len(got) != len(rule.smp):
            names = [s.replace("{i}", index or "") for s in rule.smp]
            missing = [s for j, s in enumerate(names) if j not in got]
            raise KeyError(f"translate_state_dict_to_hf_{family}: {hf_key!r} is built from "
                           f"{names}, but {missing} is missing from the state dict")
        _put(out, hf_key, _backward(rule.kind, [got[j] for j in range(len(rule.smp))]), family,
             hf_key)
    if max_seq_len is not None:
        for i in sorted(layers):
            for name, buf in _causal_buffers(family, max_seq_len).items():
                out[layout.layer_prefix.replace("{i}", str(i)) + name] = buf
    return out


def _forward(kind: str, value: Any, key: str, family: str) -> List[Any]:
    if kind == SAME:
        return [value]
    if kind == TRANSPOSE:
        return [value.t().contiguous()]
    if value.shape[-1] % 3:
        raise ValueError(f"translating a {family} state dict: {key!r} has {value.shape[-1]} "
                         "fused query/key/value features, not a multiple of 3")
    chunks = value.chunk(3, dim=-1)
    if kind == SPLIT3_T:
        return [c.t().contiguous() for c in chunks]
    return [c.clone() for c in chunks]  # SPLIT3: biases


def _backward(kind: str, values: List[Any]) -> Any:
    if kind == SAME:
        return values[0]
    if kind == TRANSPOSE:
        return values[0].t().contiguous()
    if kind == SPLIT3_T:
        return torch.cat([v.t() for v in values], dim=1)
    return torch.cat(values, dim=0)


def _causal_buffers(family: str, n: int) -> Dict[str, torch.Tensor]:
    """The buffers transformers 4.x GPT-style attentions saved: a lower-triangular `bias` mask
    [1, 1, n, n] and `masked_bias` (-1e4), under the attention module."""
    tril = torch.tril(torch.ones((n, n), dtype=torch.bool)).view(1, 1, n, n)
    prefix = "attn.attention." if family == "gptneo" else "attn."
    return {prefix + "bias": tril, prefix + "masked_bias": torch.tensor(-1e4)}


def prefixed(fn: Any, prefix: str) -> Any:
    """`fn` applied to the entries of a state dict under `prefix` (a replaced model inside a
    user's wrapper module); other entries unchanged."""
    if not prefix:
        return fn

    def run(sd: Dict[str, Any]) -> Dict[str, Any]:
        inner = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
        out = {k: v for k, v in sd.items() if not k.startswith(prefix)}
        out.update({prefix + k: v for k, v in fn(inner).items()})
        return out

    return run
