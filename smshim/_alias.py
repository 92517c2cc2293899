"""The `smdistributed` import alias.

Installing smshim puts `smshim_alias.pth` into site-packages; Python runs it at start-up and it
imports this module, which puts a finder at the front of `sys.meta_path`. The finder answers for
`smdistributed` and every `smdistributed.<x>` by importing `smshim.<x>` and handing back that very
module object, so `smdistributed.modelparallel.torch is smshim.modelparallel.torch` (one set of
globals, one `smp.state`), and `importlib.util.find_spec("smdistributed")` finds it (Hugging Face
detects the library that way).

A genuine `smdistributed` (SageMaker's containers ship one) always wins: before aliasing the top
level, the finder asks the normal path finder, and if a real package is there it steps aside and
logs a warning saying so. `SMSHIM_ALIAS=force` uses smshim anyway (warning), `SMSHIM_ALIAS=0`
turns the alias off. The finder sits first because submodules of an aliased package would
otherwise be found a second time, under the other name, by the normal path finder.

The same module installs a second, independent finder for SMP v2's `torch.sagemaker` (SageMaker
ships it as a subpackage inside its own torch build). `TorchSagemakerAliasFinder` answers only for
`torch.sagemaker` and `torch.sagemaker.<x>`, mapping them to `smshim.torch_sagemaker[.x]` the same
way. It never imports torch itself and changes nothing in torch: it is consulted only when a script
imports `torch.sagemaker`, by which time Python has imported torch as the parent; the import system
then sets `torch.sagemaker` on the torch module, as for any subpackage. A genuine `torch.sagemaker`
inside the installed torch (SMP's containers) wins; SMSHIM_ALIAS governs both aliases.

This module runs at every interpreter start: it must stay cheap and import nothing heavy.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
from types import ModuleType

ALIAS = "smdistributed"
TARGET = "smshim"

logger = logging.getLogger(__name__)


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str) -> None:
        self._target = target
        self._target_spec = None

    def create_module(self, spec):
        module = importlib.import_module(self._target)
        self._target_spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system stamped the alias spec on the shared module object; give the module
        # back its own spec so `smshim.x` keeps working as itself (reload, pickling, find_spec).
        module.__spec__ = self._target_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    """Maps `<alias>[.x]` to `<target>[.x]` unless a genuine `<alias>` is installed (one finder
    per alias: the two differ only in their names and in where a genuine package would be)."""

    alias = target = ""
    genuine_found = ""  # warning when a genuine package is there, with its location as %s
    forced = ""  # warning under SMSHIM_ALIAS=force when one is there

    def _genuine(self):
        return importlib.machinery.PathFinder.find_spec(self.alias)

    def find_spec(self, fullname, path=None, target=None):
        alias = self.alias
        if fullname != alias and not fullname.startswith(alias + "."):
            return None
        mode = os.environ.get("SMSHIM_ALIAS", "auto").lower()
        if mode in ("0", "off", "false", "no"):
            return None
        if fullname == alias:
            genuine = self._genuine()
            if genuine is not None and mode != "force":
                logger.warning(self.genuine_found,
                               genuine.origin or list(genuine.submodule_search_locations or []))
                return None
            if genuine is not None:
                logger.warning(self.forced)
        else:
            # Only alias submodules of our own alias; a genuine parent keeps its own children.
            parent = sys.modules.get(alias)
            if parent is None or parent is not sys.modules.get(self.target):
                return None
        target_name = self.target + fullname[len(alias):]
        try:
            target_spec = importlib.util.find_spec(target_name)
        except ModuleNotFoundError:
            return None
        if target_spec is None:
            return None
        return importlib.machinery.ModuleSpec(
            fullname,
            _AliasLoader(target_name),
            origin=target_spec.origin,
            is_package=target_spec.submodule_search_locations is not None,
        )


class SmdistributedAliasFinder(_AliasFinder):
    """Maps `smdistributed[.x]` to `smshim[.x]` unless a genuine smdistributed is installed."""

    alias, target = ALIAS, TARGET
    genuine_found = ("a genuine smdistributed is installed at %s; smshim does not shadow it. "
                     "Set SMSHIM_ALIAS=force to use smshim instead.")
    forced = "SMSHIM_ALIAS=force: smshim shadows the installed smdistributed"


TSM_ALIAS = "torch.sagemaker"
TSM_TARGET = "smshim.torch_sagemaker"


class TorchSagemakerAliasFinder(_AliasFinder):
    """Maps `torch.sagemaker[.x]` to `smshim.torch_sagemaker[.x]` unless torch ships its own."""

    alias, target = TSM_ALIAS, TSM_TARGET
    genuine_found = ("the installed torch has its own torch.sagemaker at %s; smshim does not "
                     "shadow it. Set SMSHIM_ALIAS=force to use smshim instead.")
    forced = "SMSHIM_ALIAS=force: smshim shadows the installed torch.sagemaker"

    def _genuine(self):
        # Inside the imported torch package (it is imported first: `torch` is the parent).
        torch = sys.modules.get("torch")
        return importlib.machinery.PathFinder.find_spec(
            TSM_ALIAS, list(getattr(torch, "__path__", None) or []))


def install() -> None:
    """Put the finders first on sys.meta_path (idempotent)."""
    if not any(isinstance(f, SmdistributedAliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, SmdistributedAliasFinder())
    if not any(isinstance(f, TorchSagemakerAliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, TorchSagemakerAliasFinder())


install()


def _teardown_at_exit() -> None:
    """At exit of a script that used torch.distributed, destroy its process groups while the
    interpreter is whole (smshim.runtime.launch.teardown). A plain torch script (DDP under
    `smshim run`) never imports smshim, and a gloo group left to finalization aborted the process
    after the script had finished ("terminate called without an active exception")."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return  # no process group: nothing to tear down (and nothing to import for it)
    from smshim.runtime.launch import teardown_at_exit

    teardown_at_exit()


def _env_on(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "off", "no")


# Workers of `smshim run` (the trampoline sets SMSHIM_WORKER) and CPU-mode processes get the
# teardown; a script run any other way keeps torch's own exit. Registered first, it runs last,
# after the script's own atexit handlers.
if _env_on("SMSHIM_WORKER") or _env_on("SMSHIM_CPU"):
    import atexit

    atexit.register(_teardown_at_exit)

# CPU mode (smshim/runtime/cpu_mode.py) must be in place before a script's first CUDA call,
# under every launcher; without SMSHIM_CPU this costs one environment lookup.
if _env_on("SMSHIM_CPU"):
    from smshim.runtime import cpu_mode

    cpu_mode.install_import_hook()
