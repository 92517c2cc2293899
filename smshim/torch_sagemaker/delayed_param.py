"""`DelayedParamIniter`: real weights for a model built on meta, one FSDP unit at a time.

The script builds the model under `init_empty_weights()` (no storage, no random draws), creates
the initer, and hands FSDP `param_init_fn=initer.get_param_init_fn()`. FSDP calls that function on
each module of a unit just before it shards the unit; it gives the module's own tensors storage on
this process's device and initialises them.

Which values: with `init_method_using_config` given, that function decides (it receives the module
with storage already allocated). Otherwise the model gets exactly the weights eager construction
would have given it under the RNG state current when the initer was created (the seed the script
set before building on meta): an eager replica `type(model)(model.config)` is built once on the
CPU from that state and each module copies its own tensors from it. That replica costs one CPU copy
of the model per process while FSDP wraps; above SMSHIM_TSM_EXACT_INIT_MAX_MB (default 2048) of
parameters, or for a model that cannot be rebuilt from its config, each module is initialised by
itself instead (`model._init_weights(module)` for HF models, else `reset_parameters()`): the same
distributions, not the same numbers, and a warning says so.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Callable, Dict, Optional

import torch

from smshim.torch_sagemaker.utils.module_utils import (default_device, empty_module_params, has_meta,
                                                        move_buffers_to_device)

logger = logging.getLogger(__name__)


def _exact_init_limit_bytes() -> int:
    return int(float(os.environ.get("SMSHIM_TSM_EXACT_INIT_MAX_MB", "2048")) * 2 ** 20)


def _copy_whole_into(dst: torch.Tensor, whole: torch.Tensor) -> None:
    """dst <- whole; a DTensor (a tsm.transform'ed TP shard) takes its own slice, cut locally."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(dst, DTensor):
        src = DTensor.from_local(whole.to(dst.device), dst.device_mesh,
                                 [Replicate()] * dst.device_mesh.ndim, run_check=False)
        dst.to_local().copy_(src.redistribute(dst.device_mesh, dst.placements).to_local())
    else:
        dst.copy_(whole)


class DelayedParamIniter:
    def __init__(self, model: torch.nn.Module,
                 init_method_using_config: Optional[Callable[[torch.nn.Module], None]] = None,
                 verbose: bool = False) -> None:
        self.model = model
        self.init_method_using_config = init_method_using_config
        self.verbose = verbose
        self._rng_state = torch.get_rng_state()
        self._names: Dict[int, str] = {id(m): n for n, m in model.named_modules()}
        self._meta_numel = self.count_num_params(model)
        self._inited_numel = 0
        self._reference: Optional[torch.nn.Module] = None
        self._exact: Optional[bool] = None if init_method_using_config is None else False

    # What FSDP gets ---------------------------------------------------------------------------
    def get_param_init_fn(self) -> Callable[[torch.nn.Module], None]:
        return self._param_init_fn

    def get_post_param_init_fn(self) -> Callable[[torch.nn.Module], None]:
        """Re-ties shared weights (HF `tie_weights`) once a module is materialised; safe always."""
        def post(module: torch.nn.Module) -> None:
            if module is self.model and hasattr(module, "tie_weights"):
                module.tie_weights()
        return post

    @staticmethod
    def count_num_params(module: torch.nn.Module, *args) -> int:
        """Elements of the meta parameters of `module` (shared parameters once)."""
        return sum(p.numel() for p in module.parameters() if p.is_meta)

    @contextlib.contextmanager
    def validate_params_and_buffers_inited(self, enabled: bool = True):
        """Around the FSDP call: afterwards no parameter or buffer may be left on meta."""
        yield
        if not enabled:
            return
        left = [n for n, t in list(self.model.named_parameters()) + list(self.model.named_buffers())
                if t.is_meta]
        if left:
            raise AssertionError(f"DelayedParamIniter: {len(left)} tensors still on meta after "
                                 f"FSDP, e.g. {left[:5]}; was param_init_fn passed to FSDP?")
        if self._inited_numel < self._meta_numel:
            raise AssertionError(f"DelayedParamIniter: initialised {self._inited_numel} of "
                                 f"{self._meta_numel} parameter elements")

    # Initialisation ---------------------------------------------------------------------------
    def _param_init_fn(self, module: torch.nn.Module) -> None:
        if not has_meta(module, recurse=False):
            return
        device = default_device()
        numel = sum(p.numel() for p in module.parameters(recurse=False) if p.is_meta)
        empty_module_params(module, device, recurse=False)
        move_buffers_to_device(module, device, recurse=False)
        with torch.no_grad():
            if self.init_method_using_config is not None:
                self.init_method_using_config(module)
            elif self._use_exact():
                self._copy_from_reference(module)
            else:
                self._init_alone(module)
        self._inited_numel += numel
        if self.verbose:
            logger.info("DelayedParamIniter: initialised %s (%d elements)",
                        self._names.get(id(module), type(module).__name__), numel)
        if self._reference is not None and self._inited_numel >= self._meta_numel:
            self._reference = None  # every module has its weights: free the replica

    def _use_exact(self) -> bool:
        if self._exact is None:
            nbytes = sum(p.numel() * p.element_size() for p in self.model.parameters() if p.is_meta)
            config = getattr(self.model, "config", None)
            self._exact = config is not None and nbytes <= _exact_init_limit_bytes()
            if self._exact:
                try:
                    with torch.random.fork_rng(devices=[]):
                        torch.set_rng_state(self._rng_state)
                        self._reference = type(self.model)(config)
                except Exception as e:  # noqa: BLE001  (fall back to per-module init, said below)
                    logger.warning("DelayedParamIniter: cannot rebuild %s from its config (%s)",
                                   type(self.model).__name__, e)
                    self._exact = False
            if not self._exact:
                logger.warning("DelayedParamIniter: initialising each module by itself (same "
                               "distributions as eager init, not the same values)")
        return self._exact

    def _copy_from_reference(self, module: torch.nn.Module) -> None:
        name = self._names.get(id(module))
        if name is None:
            raise RuntimeError(f"DelayedParamIniter: FSDP asked for a module that was not in the "
                               f"model when the initer was made ({type(module).__name__})")
        ref = self._reference.get_submodule(name)
        for pname, p in module.named_parameters(recurse=False):
            _copy_whole_into(p, getattr(ref, pname))
        for bname, b in module.named_buffers(recurse=False):
            ref_b = getattr(ref, bname, None)
            if ref_b is not None:
                _copy_whole_into(b, ref_b)

    def _init_alone(self, module: torch.nn.Module) -> None:
        init_weights = getattr(self.model, "_init_weights", None)
        if init_weights is not None:
            init_weights(module)
        elif hasattr(module, "reset_parameters"):
            module.reset_parameters()


__all__ = ["DelayedParamIniter"]
