"""`apply`: the engine behind `tsm.transform` (tensor, context and expert parallelism for Hugging
Face causal LMs). The model stays the same Hugging Face class and module tree (state-dict keys in
HF layout, FSDP auto-wrap on the HF decoder layer class); split weights become DTensors.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from smshim.torch_sagemaker.parallelize import causal_lm, context_parallel, rank0_load, rng
from smshim.torch_sagemaker.parallelize.gpt_neox import GPT_NEOX
from smshim.torch_sagemaker.parallelize.llama import LLAMA, MISTRAL
from smshim.torch_sagemaker.parallelize.mixtral import MIXTRAL
from smshim.torch_sagemaker.parallelize.plan import FamilyPlan
from smshim.torch_sagemaker.parallelize.tensor_parallel import (check_divisible, parallelize_layers,
                                                              parallelize_vocab, split_param_names)

logger = logging.getLogger(__name__)

PLANS = (LLAMA, MISTRAL, GPT_NEOX, MIXTRAL)
SUPPORTED = tuple(c for p in PLANS for c in p.model_classes)


class UnsupportedModelError(TypeError):
    """tsm.transform was given a model class it has no plan for."""


@dataclass
class TransformInfo:
    """Kept on the transformed model as `_smshim_transform` (read by grad_norm / hf_state_dict)."""

    plan: FamilyPlan
    tp_mesh: Optional[DeviceMesh]
    cp_mesh: Optional[DeviceMesh]
    ep_mesh: Optional[DeviceMesh]
    tp_sharded: frozenset  # parameter names (HF layout) whose tensors are split over tp_mesh


def find_plan(model: nn.Module) -> FamilyPlan:
    names = [c.__name__ for c in type(model).__mro__]
    for plan in PLANS:
        if any(n in plan.model_classes for n in names):
            return plan
    raise UnsupportedModelError(
        f"tsm.transform does not support {type(model).__name__}; supported: "
        f"{', '.join(SUPPORTED)} (pass the causal-LM model, e.g. AutoModelForCausalLM)")


def _size(mesh: Optional[DeviceMesh]) -> int:
    return 1 if mesh is None else mesh.size()


def _check(model, plan, tp_mesh, cp_mesh, ep_mesh, cp_comm_type, config) -> None:
    """Every refusal, before any collective (all ranks hold the same arguments)."""
    tp, cp, ep = _size(tp_mesh), _size(cp_mesh), _size(ep_mesh)
    cls = type(model).__name__
    if ep > 1 and tp > 1:
        raise ValueError(f"expert_parallel_degree {ep} cannot be combined with "
                         f"tensor_parallel_degree {tp}; set one of them to 1")
    if tp > 1 and not plan.supports_tp:
        raise UnsupportedModelError(f"{cls}: tensor parallelism is not supported for this family "
                                    "here; use expert_parallel_degree for Mixtral")
    if ep > 1 and not plan.supports_ep:
        raise UnsupportedModelError(f"{cls}: expert parallelism needs a Mixture-of-Experts model "
                                    f"(supported: {', '.join(MIXTRAL.model_classes)})")
    if cp > 1:
        if not plan.supports_cp:
            raise UnsupportedModelError(f"{cls}: context parallelism is supported for "
                                        "Llama, Mistral and GPT-NeoX only")
        if cp_comm_type not in context_parallel.COMM_TYPES:
            raise ValueError(f"cp_comm_type must be one of {context_parallel.COMM_TYPES}, "
                             f"not {cp_comm_type!r}")
        if getattr(model.config, "sliding_window", None):
            raise ValueError(f"{cls} with sliding_window={model.config.sliding_window}: context "
                             "parallelism needs full causal attention (set sliding_window=None)")
    if tp > 1:
        check_divisible(model, plan, tp)
    if ep > 1 and model.config.num_local_experts % ep:
        raise ValueError(f"expert_parallel_degree {ep} must divide the "
                         f"{model.config.num_local_experts} experts of {cls}")
    if config is not None and plan.supports_ep:
        from smshim.torch_sagemaker.parallelize.moe.moe_config import MoEConfig
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config for {cls} must be a MoEConfig, got {type(config).__name__}")
    if config is not None and ep <= 1 and getattr(config, "smp_moe", False) and plan.supports_ep:
        logger.info("MoEConfig given without expert parallelism: experts stay whole")


def apply(model: nn.Module, *, tp_mesh: Optional[DeviceMesh], cp_mesh: Optional[DeviceMesh] = None,
          ep_mesh: Optional[DeviceMesh] = None, device=None, dtype=None, config=None,
          load_state_dict_from_rank0: bool = False, cp_comm_type: str = "p2p",
          random_seed: Optional[int] = None) -> nn.Module:
    """Split `model` (a supported HF causal LM, changed in place and returned) over the meshes.

    tp_mesh: 1-D mesh of this rank's TP group (None or size 1: no TP). cp_mesh / ep_mesh: the
    same for context / expert parallelism. device / dtype: move or cast first (ignored while the
    model is on meta). config: a MoEConfig for Mixtral. load_state_dict_from_rank0: every rank
    takes rank 0's weights (collective over the world group). random_seed: dropout inside split
    modules uses random_seed + the TP (or EP) rank.
    """
    plan = find_plan(model)
    _check(model, plan, tp_mesh, cp_mesh, ep_mesh, cp_comm_type, config)
    tp, cp, ep = _size(tp_mesh), _size(cp_mesh), _size(ep_mesh)
    on_meta = any(p.is_meta for p in model.parameters())
    if load_state_dict_from_rank0:
        rank0_load.broadcast_from_rank0(model, torch.device(device or "cpu"))
        on_meta = False
    if not on_meta and (device is not None or dtype is not None):
        model.to(device=device, dtype=dtype)

    sharded: frozenset = frozenset()
    if tp > 1:
        parallelize_layers(model, plan, tp_mesh)
        parallelize_vocab(model, plan, tp_mesh)
        sharded = split_param_names(model)

    if ep > 1:
        from smshim.torch_sagemaker.parallelize.moe.expert_parallel import parallelize_experts
        sharded = sharded | parallelize_experts(model, plan, ep_mesh, config)
    elif config is not None and plan.supports_ep:
        from smshim.torch_sagemaker.parallelize.moe.expert_parallel import apply_routing
        apply_routing(model, plan, config)

    if cp > 1:
        context_parallel.register()
        model.config._attn_implementation = context_parallel.ATTN_IMPLEMENTATION
        for layer in model.get_submodule(plan.layers):
            layer.get_submodule(plan.attention)._smshim_cp = context_parallel.CPContext(
                cp_mesh, cp_comm_type)

    if random_seed is not None and (tp > 1 or ep > 1):
        local_rank = (tp_mesh if tp > 1 else ep_mesh).get_local_rank()
        rng.seed_split_modules([layer.get_submodule(plan.attention)
                                for layer in model.get_submodule(plan.layers)],
                               random_seed + local_rank)

    if tp > 1 or cp > 1 or getattr(model, "_smshim_z_losses", None) is not None:
        causal_lm.install(model, causal_lm.ForwardSetup(tp_mesh if tp > 1 else None,
                                                        cp_mesh if cp > 1 else None))
    model._smshim_transform = TransformInfo(plan, tp_mesh, cp_mesh, ep_mesh, sharded)
    logger.info("transformed %s: tp=%d cp=%d ep=%d", type(model).__name__, tp, cp, ep)
    return model
