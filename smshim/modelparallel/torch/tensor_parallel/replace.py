"""Which modules become tensor parallel: `smp.tensor_parallelism()`, `smp.set_tensor_parallelism()`,
`smp.tp_register()` / `smp.tp_register_with_module()`, and the replacement itself, done when the
`DistributedModel` is created (`distribute`).

Marking. A module carries `_smp_tp_mark = (enabled, config, created_inside)`. Inside `with
smp.tensor_parallelism(enabled, **config)`, every module that registers a parameter or a
submodule is marked (torch's global registration hooks), the innermost context first, and a mark
is never overwritten by an outer context. `set_tensor_parallelism(module, enabled, **config)`
marks `module` and everything below it (overwriting; created_inside False).

Hugging Face models SMP supports out of the box (SPEC §7.6). A model of such a class
(GPT2LMHeadModel, GPTNeoForCausalLM, GPTJForCausalLM, BertForMaskedLM, RobertaForMaskedLM:
nn/hf_*_lm.py) *created inside* an enabled context becomes smp's distributed transformer
(`DistributedTransformerLMHead` family) built from its config and holding its weights, at any
tensor_parallel_degree (whole at 1), and the (smp -> Hugging Face, Hugging Face -> smp)
state-dict translators are registered in `smp.state.module_manager.translate_functions`, so full
checkpoints are written in Hugging Face's layout. Marked afterwards by `set_tensor_parallelism`, the
same model keeps Hugging Face's implementation and layout, and its blocks are split in place (as
for the classes SMP never replaced, such as GPT-NeoX); so is a model whose config the distributed
transformer cannot compute exactly.

Replacement (`distribute`, tensor_parallel_degree > 1). Walking the tree from the root, the first
(outermost) module that is marked enabled and supported is replaced, and nothing below it is
visited. Supported: torch.nn.Linear -> smp.nn.DistributedLinear, torch.nn.Embedding ->
smp.nn.DistributedEmbedding (both keep the original weights: each rank takes its shard), the Hugging
Face blocks GPT2Block, GPTNeoXLayer and BertLayer (distributed in place, keeping their weights:
nn/hf_gpt2.py, nn/hf_gpt_neox.py, nn/hf_bert.py; a block whose mapping would not be exact stays
whole, logged, and nothing inside it is distributed), and classes registered with `tp_register`
(built by the distributed class's constructor from the recorded constructor arguments, as SageMaker
does; their weights are the distributed module's own initialisation). A module that shares a
parameter with a module outside it, appears twice in the tree, or whose sizes do not divide by
tp_size stays undistributed (logged). `config` entries override the distributed module's
constructor arguments when it has them; `fused_softmax` / `fused_bias_gelu` only change speed on
SageMaker's GPUs.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, Type

from torch import nn

from smshim.modelparallel.torch.tensor_parallel import nn as smp_nn
from smshim.modelparallel.torch.tensor_parallel.nn import (hf_bert, hf_bert_lm, hf_gpt2, hf_gpt2_lm,
                                                           hf_gpt_neox, hf_gptj_lm, hf_gptneo_lm,
                                                           hf_layouts)
from smshim.modelparallel.torch.state import state

logger = logging.getLogger(__name__)

__all__ = ["tensor_parallelism", "set_tensor_parallelism", "tp_register",
           "tp_register_with_module", "distribute"]

_MARK = "_smp_tp_mark"
_INIT_ARGS = "_smp_tp_init_args"
_PERF_ONLY = ("fused_softmax", "fused_bias_gelu")


@dataclass
class _Registration:
    dist_module: Type[nn.Module]
    init_hook: Optional[Callable] = None
    forward_hook: Optional[Callable] = None
    return_hook: Optional[Callable] = None


_registry: Dict[type, _Registration] = {}
# Hugging Face blocks distributed in place: (is this family's block, distribute it or None).
_HF_BLOCKS: List[Tuple[Callable[[nn.Module], bool], Callable[[nn.Module], Optional[nn.Module]]]] = [
    (hf_gpt2.is_gpt2_block, hf_gpt2.distribute_block),
    (hf_gpt_neox.is_gpt_neox_layer, hf_gpt_neox.distribute_block),
    (hf_bert.is_bert_layer, hf_bert.distribute_block),
]
# Hugging Face models replaced whole by smp's transformer: (is this class, family, build it
# or None).
_HF_MODELS: List[Tuple[Callable[[nn.Module], bool], str,
                       Callable[[nn.Module], Optional[nn.Module]]]] = [
    (hf_gpt2_lm.is_gpt2_lm, "gpt2", hf_gpt2_lm.replace_model),
    (hf_bert_lm.is_bert_mlm, "bert", hf_bert_lm.replace_model),
    (hf_bert_lm.is_roberta_mlm, "roberta", hf_bert_lm.replace_model),
    (hf_gptneo_lm.is_gptneo_lm, "gptneo", hf_gptneo_lm.replace_model),
    (hf_gptj_lm.is_gptj_lm, "gptj", hf_gptj_lm.replace_model),
]
_contexts: List[Tuple[bool, Dict[str, Any], bool]] = []


# Marking ------------------------------------------------------------------------------------
def _mark_new(module: nn.Module) -> None:
    if _contexts and _MARK not in module.__dict__:
        module.__dict__[_MARK] = _contexts[-1]


def _on_param(module: nn.Module, name: str, param: Any) -> None:
    _mark_new(module)


def _on_module(module: nn.Module, name: str, sub: Any) -> None:
    if isinstance(sub, nn.Module):
        _mark_new(sub)
    _mark_new(module)


@contextlib.contextmanager
def tensor_parallelism(enabled: bool = True, **tensor_parallel_config: Any) -> Iterator[None]:
    """Modules created inside are marked for tensor parallelism (or against it, enabled=False);
    they are distributed when the DistributedModel is created."""
    _contexts.append((bool(enabled), dict(tensor_parallel_config), True))
    handles = [nn.modules.module.register_module_parameter_registration_hook(_on_param),
               nn.modules.module.register_module_module_registration_hook(_on_module)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        _contexts.pop()


def set_tensor_parallelism(module: nn.Module, enabled: bool = True,
                           **tensor_parallel_config: Any) -> None:
    """Mark `module` and all its submodules; call after creation, before DistributedModel."""
    if state.model is not None:
        raise RuntimeError(
            f"smp.set_tensor_parallelism({type(module).__name__}) must be called before "
            "smp.DistributedModel(...) is created: the modules are distributed then")
    mark = (bool(enabled), dict(tensor_parallel_config), False)
    for m in module.modules():
        m.__dict__[_MARK] = mark


# Registration -------------------------------------------------------------------------------
def _record_init_args(cls: type) -> None:
    """Wrap `cls.__init__` so that each instance remembers its constructor arguments."""
    init = cls.__init__
    if getattr(init, "_smp_tp_recording", False):
        return

    @functools.wraps(init)
    def __init__(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        if type(self) is cls:  # a subclass is not the registered class
            self.__dict__[_INIT_ARGS] = (args, kwargs)

    __init__._smp_tp_recording = True  # type: ignore[attr-defined]
    cls.__init__ = __init__  # type: ignore[misc]


def tp_register_with_module(module_cls: type, dist_module: Type[nn.Module],
                            init_hook: Optional[Callable] = None,
                            forward_hook: Optional[Callable] = None,
                            return_hook: Optional[Callable] = None) -> None:
    """Instances of `module_cls` created from now on can be replaced by `dist_module`.
    init_hook / forward_hook take the original __init__ / forward arguments (without self) and
    return (args, kwargs) for the distributed module's; return_hook maps its output back."""
    if not (isinstance(module_cls, type) and issubclass(module_cls, nn.Module)):
        raise TypeError(f"smp.tp_register_with_module: {module_cls!r} is not an nn.Module class")
    if not (isinstance(dist_module, type) and issubclass(dist_module, nn.Module)):
        raise TypeError(f"smp.tp_register_with_module: dist_module {dist_module!r} is not an "
                        "nn.Module class")
    _record_init_args(module_cls)
    _registry[module_cls] = _Registration(dist_module, init_hook, forward_hook, return_hook)


def tp_register(dist_module: Type[nn.Module], init_hook: Optional[Callable] = None,
                forward_hook: Optional[Callable] = None,
                return_hook: Optional[Callable] = None) -> Callable[[type], type]:
    """Class decorator: `@smp.tp_register(DistModule, ...)` on a module class."""
    def decorate(cls: type) -> type:
        tp_register_with_module(cls, dist_module, init_hook, forward_hook, return_hook)
        return cls
    return decorate


# Replacement --------------------------------------------------------------------------------
def _accepted(cls: type, config: Dict[str, Any]) -> Dict[str, Any]:
    """The config entries `cls`'s constructor takes (others target other module kinds)."""
    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return dict(config)
    return {k: v for k, v in config.items() if k in params and k not in _PERF_ONLY}


def _convert_linear(m: nn.Linear, config: Dict[str, Any]) -> nn.Module:
    new = smp_nn.DistributedLinear(m.in_features, m.out_features, bias=m.bias is not None)
    new.load_state_dict(m.state_dict())
    return new


def _convert_embedding(m: nn.Embedding, config: Dict[str, Any]) -> Optional[nn.Module]:
    if m.max_norm is not None or m.sparse:
        logger.info("nn.Embedding with max_norm or sparse gradients is left undistributed")
        return None
    kwargs = _accepted(smp_nn.DistributedEmbedding, config)
    kwargs.update(padding_idx=m.padding_idx, scale_grad_by_freq=m.scale_grad_by_freq,
                  _weight=m.weight.detach())
    return smp_nn.DistributedEmbedding(m.num_embeddings, m.embedding_dim, **kwargs)


def _convert_registered(m: nn.Module, reg: _Registration,
                        config: Dict[str, Any]) -> Optional[nn.Module]:
    recorded = m.__dict__.get(_INIT_ARGS)
    if recorded is None:
        logger.warning("%s was created before it was registered with smp.tp_register: its "
                       "constructor arguments are unknown, so it stays undistributed",
                       type(m).__name__)
        return None
    args, kwargs = recorded
    if reg.init_hook is not None:
        args, kwargs = reg.init_hook(*args, **kwargs)
    kwargs = {**kwargs, **_accepted(reg.dist_module, config)}
    new = reg.dist_module(*args, **kwargs)
    if reg.forward_hook is not None or reg.return_hook is not None:
        new.forward = functools.partial(_hooked_forward, new.forward, reg)  # type: ignore
    return new


def _hooked_forward(forward: Callable, reg: _Registration, *args: Any, **kwargs: Any) -> Any:
    if reg.forward_hook is not None:
        args, kwargs = reg.forward_hook(*args, **kwargs)
    out = forward(*args, **kwargs)
    return reg.return_hook(out) if reg.return_hook is not None else out


def _convert(m: nn.Module, config: Dict[str, Any]) -> Optional[nn.Module]:
    reg = _registry.get(type(m))
    try:
        if reg is not None:
            return _convert_registered(m, reg, config)
        if type(m) is nn.Linear:
            return _convert_linear(m, config)
        if type(m) is nn.Embedding:
            return _convert_embedding(m, config)
        for is_block, distribute_block in _HF_BLOCKS:
            if is_block(m):
                return distribute_block(m)
    except ValueError as e:  # sizes not divisible by tp_size
        logger.info("%s stays undistributed: %s", type(m).__name__, e)
    return None


def _replace_hf_model(m: nn.Module, name: str) -> Optional[nn.Module]:
    """smp's transformer for a supported Hugging Face model (None: keep it), its translators
    registered for the checkpoints."""
    for is_model, family, build in _HF_MODELS:
        if not is_model(m):
            continue
        try:
            new = build(m)
        except ValueError as e:  # sizes not divisible by tp_size
            logger.info("%s (%s) kept as Hugging Face's implementation: %s", name or "<root>",
                        type(m).__name__, e)
            return None
        if new is not None:
            prefix = f"{name}." if name else ""
            state.module_manager.translate_functions.append((
                hf_layouts.prefixed(functools.partial(hf_layouts.smp_to_hf, family), prefix),
                hf_layouts.prefixed(functools.partial(hf_layouts.hf_to_smp, family), prefix)))
        return new
    return None


def _supported(m: nn.Module) -> bool:
    return (type(m) in _registry or type(m) in (nn.Linear, nn.Embedding)
            or any(is_block(m) for is_block, _ in _HF_BLOCKS))


def _shares_weights(m: nn.Module, root: nn.Module, occurrences: Dict[int, int]) -> bool:
    if occurrences.get(id(m), 0) > 1:
        return True
    inside = {id(x) for x in m.modules()}
    mine = {id(p) for p in m.parameters()}
    for other in root.modules():
        if id(other) in inside:
            continue
        if any(id(p) in mine for p in other.parameters(recurse=False)):
            return True
    return False


def distribute(root: nn.Module) -> nn.Module:
    """Replace the outermost marked, supported modules of `root` by their distributed versions
    (see the module docstring); returns the root (itself replaced if it qualifies)."""
    tp_size = state.topology.tp_size
    occurrences: Dict[int, int] = {}
    for _, m in root.named_modules(remove_duplicate=False):
        occurrences[id(m)] = occurrences.get(id(m), 0) + 1
    replaced: List[str] = []
    # Hugging Face blocks whose mapping was refused (logged by the mapping): they stay whole, so
    # their nn.Linear projections are not distributed one by one either.
    whole: set = set()

    def consider(m: nn.Module, name: str) -> Optional[nn.Module]:
        mark = m.__dict__.get(_MARK)
        if not (mark and mark[0]) or getattr(m, "_smp_tp_done", False):
            return None
        if len(mark) > 2 and mark[2]:
            new = _replace_hf_model(m, name)
            if new is not None:
                new.__dict__["_smp_tp_done"] = True
                replaced.append(f"{name or '<root>'} ({type(m).__name__} -> "
                                f"{type(new).__name__})")
                return new
        if tp_size == 1 or not _supported(m):  # tp 1: only Hugging Face models are replaced
            return None
        if _shares_weights(m, root, occurrences):
            logger.info("%s (%s) shares parameters with another module: left undistributed",
                        name or "<root>", type(m).__name__)
            return None
        new = _convert(m, mark[1])
        if new is not None:
            new.__dict__["_smp_tp_done"] = True
            replaced.append(f"{name or '<root>'} ({type(m).__name__})")
        elif any(is_block(m) for is_block, _ in _HF_BLOCKS):
            whole.add(id(m))
        return new

    def visit(parent: nn.Module, prefix: str) -> None:
        for name, child in list(parent.named_children()):
            full = f"{prefix}{name}"
            new = consider(child, full)
            if new is not None:
                if new is not child:
                    setattr(parent, name, new)
                continue
            if id(child) not in whole:
                visit(child, full + ".")

    new_root = consider(root, "")
    if new_root is not None:
        root = new_root
    else:
        visit(root, "")
    logger.info("tensor parallelism (tp_size %d) distributed: %s", tp_size,
                ", ".join(replaced) or "nothing")
    return root
