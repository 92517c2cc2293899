"""CPU mode: run a GPU training script unchanged on a machine without CUDA (opt-in).

Turned on by `SMSHIM_CPU=1` (which `smshim run --cpu` sets), under any launcher: the start-up
hook (smshim/_alias.py) calls `install_import_hook()`, which waits for the script's own
`import torch` and then maps the device lines AWS scripts carry onto the CPU:

  torch.cuda.set_device(i), torch.cuda.current_device(), torch.cuda.synchronize()
  tensor.cuda() / module.cuda()
  tensor.to("cuda"), .to("cuda:1"), .to(torch.device("cuda", i)), .to(i)  (and module.to)
  DistributedDataParallel(model, device_ids=[i], output_device=i) on a CPU model
  torch.load(..., map_location="cuda:0" | torch.device("cuda") | {"cuda:1": "cuda:0"})
  tensors created on a CUDA device: torch.zeros(3, device="cuda"), torch.tensor(x, device=d),
    torch.arange(n, device=torch.device("cuda", i)), torch.randn_like(t, device=0),
    t.new_zeros(3, device="cuda") and the other factories in _FACTORIES / _NEW_FACTORIES

`torch.cuda.is_available()` and `torch.cuda.device_count()` keep telling the truth, so an
explicit "no GPU, stop" guard in a script still stops it. The factories are wrapped where a script
finds them (`torch.zeros`, `Tensor.new_zeros`): a module that took its own reference before torch
finished importing keeps the original. Without SMSHIM_CPU nothing here runs (the start-up hook only
reads the variable), and with a real GPU nothing is patched.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import os
import sys
from typing import Any

logger = logging.getLogger("smshim.cpu")

ENV = "SMSHIM_CPU"
_WARNED_ENV = "SMSHIM_CPU_WARNED"  # set once the job's one warning was given (inherited by workers)

MAPPED = ("torch.cuda.set_device", "torch.cuda.current_device", "torch.cuda.synchronize",
          ".cuda()", '.to("cuda"/"cuda:i"/torch.device("cuda", i)/i)',
          "DistributedDataParallel(device_ids=..., output_device=...)",
          'torch.load(map_location="cuda...")',
          'torch.zeros(..., device="cuda") and the other factories')

# Functions in the torch namespace that create a tensor on the device their `device=` names.
_FACTORIES = ("zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm", "arange",
              "range", "linspace", "logspace", "eye", "tensor", "as_tensor", "zeros_like",
              "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "randint_like",
              "empty_strided", "scalar_tensor", "tril_indices", "triu_indices", "normal")
_NEW_FACTORIES = ("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor",
                  "new_empty_strided")

_installed = False


def requested(env=os.environ) -> bool:
    """SMSHIM_CPU is set to something other than 0/false/off."""
    return env.get(ENV, "").strip().lower() not in ("", "0", "false", "off", "no")


def _is_rank0(env=os.environ) -> bool:
    for key in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if key in env:
            return env[key] == "0"
    return True


def warn_once(cuda_available: bool = False) -> None:
    """The one start-up warning of a job (the launcher, or rank 0 when no launcher gave it)."""
    if os.environ.get(_WARNED_ENV) == "1" or not _is_rank0():
        return
    os.environ[_WARNED_ENV] = "1"
    if cuda_available:
        logger.warning("%s=1 is ignored: this machine has CUDA devices, so nothing is mapped", ENV)
        return
    logger.warning("CPU mode (%s=1): no CUDA here, so these GPU calls run on the CPU: %s. "
                   "torch.cuda.is_available() still returns False; unset %s to turn this off.",
                   ENV, ", ".join(MAPPED), ENV)


# ---- the mapping ---------------------------------------------------------------------------------
def _cuda_like(x: Any) -> bool:
    import torch

    if isinstance(x, str):
        return x == "cuda" or x.startswith("cuda:")
    if isinstance(x, torch.device):
        return x.type == "cuda"
    return False


def _map_device(x: Any) -> Any:
    return "cpu" if _cuda_like(x) else x


def _on_cpu(factory: Any) -> Any:
    """`factory` with a CUDA `device=` (a name, a torch.device, or an index, which factories
    read as a CUDA device) replaced by the CPU."""
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and (_cuda_like(device) or (
                isinstance(device, int) and not isinstance(device, bool))):
            kwargs["device"] = "cpu"
        return factory(*args, **kwargs)

    wrapper._smshim_cpu = True  # type: ignore[attr-defined]
    return wrapper


def _to_args(args: tuple, kwargs: dict) -> tuple:
    """.to(...)'s arguments with a CUDA device (or a bare device index) replaced by the CPU."""
    if args and (_cuda_like(args[0]) or (isinstance(args[0], int) and not isinstance(args[0], bool))):
        args = ("cpu",) + args[1:]
    if "device" in kwargs:
        kwargs = dict(kwargs, device=_map_device(kwargs["device"]))
    return args, kwargs


def _map_location(loc: Any) -> Any:
    if isinstance(loc, dict):
        return {k: _map_device(v) for k, v in loc.items()}
    return _map_device(loc)


def _patch(torch: Any) -> None:
    """Apply the mapping to an imported torch (only when it has no CUDA device)."""
    global _installed
    if _installed:
        return
    if torch.cuda.is_available():
        warn_once(cuda_available=True)
        return
    _installed = True
    state = {"device": 0}

    def set_device(device: Any) -> None:
        idx = getattr(device, "index", device)
        state["device"] = int(idx) if isinstance(idx, int) else 0

    torch.cuda.set_device = set_device
    torch.cuda.current_device = lambda: state["device"]
    torch.cuda.synchronize = lambda device=None: None

    tensor_to, module_to = torch.Tensor.to, torch.nn.Module.to

    @functools.wraps(tensor_to)
    def tensor_to_cpu(self, *args, **kwargs):
        args, kwargs = _to_args(args, kwargs)
        return tensor_to(self, *args, **kwargs)

    @functools.wraps(module_to)
    def module_to_cpu(self, *args, **kwargs):
        args, kwargs = _to_args(args, kwargs)
        return module_to(self, *args, **kwargs)

    torch.Tensor.to, torch.nn.Module.to = tensor_to_cpu, module_to_cpu
    torch.Tensor.cuda = lambda self, device=None, non_blocking=False, **kw: self
    torch.nn.Module.cuda = lambda self, device=None: self

    load = torch.load

    @functools.wraps(load)
    def load_cpu(*args, **kwargs):
        if "map_location" in kwargs:
            kwargs["map_location"] = _map_location(kwargs["map_location"])
        elif len(args) >= 2:
            args = (args[0], _map_location(args[1])) + args[2:]
        else:
            kwargs["map_location"] = "cpu"  # a checkpoint saved on a GPU loads here too
        return load(*args, **kwargs)

    torch.load = load_cpu

    from torch.nn.parallel import DistributedDataParallel as DDP

    ddp_init = DDP.__init__

    @functools.wraps(ddp_init)
    def ddp_init_cpu(self, module, device_ids=None, output_device=None, *args, **kwargs):
        # DDP refuses device_ids for a CPU module; on the CPU there is only one device anyway.
        return ddp_init(self, module, None, None, *args, **kwargs)

    DDP.__init__ = ddp_init_cpu

    for name in _FACTORIES:
        fn = getattr(torch, name, None)
        if fn is not None and not getattr(fn, "_smshim_cpu", False):
            setattr(torch, name, _on_cpu(fn))
    for name in _NEW_FACTORIES:
        fn = getattr(torch.Tensor, name, None)
        if fn is not None and not getattr(fn, "_smshim_cpu", False):
            setattr(torch.Tensor, name, _on_cpu(fn))
    warn_once()


# ---- installation ------------------------------------------------------------------------------
class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Patches torch right after the script's own `import torch` finishes."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch":
            return None
        sys.meta_path.remove(self)  # once; and so the lookup below does not find us again
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            _patch(module)

        spec.loader.exec_module = exec_then_patch  # type: ignore[method-assign]
        return spec


def install_import_hook() -> None:
    """Map the CUDA calls once torch is imported (now, if it already is)."""
    if "torch" in sys.modules:
        _patch(sys.modules["torch"])
    elif not any(isinstance(f, _TorchImportHook) for f in sys.meta_path):
        sys.meta_path.insert(0, _TorchImportHook())
