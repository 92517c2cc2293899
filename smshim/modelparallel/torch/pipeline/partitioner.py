"""Deciding which pipeline partition (pp rank) owns each module.

Manual: `with smp.partition(i):` around module construction, or `smp.set_partition(module, i)`;
unassigned modules go to `default_partition`; the root is always partition 0.

Automatic (SPEC §2 "Partitioning"): pp_rank 0 traces one microbatch (forward only, no grad) with
hooks on every module, recording execution order, parameter bytes, output (activation) bytes and,
if asked, times. Each module's cost is
    memory_weight * memory + (1 - memory_weight) * compute
with memory = 3 x parameter bytes (weights, gradient-free optimizer state) + activation bytes and
compute = measured time, or activation + parameter bytes when times are not traced; both are
normalised by the model totals so the weight means what it says. Then, top-down from the root:
a parent's children, in execution order, are split into contiguous groups that minimise the
largest group's cost; devices go to the groups in proportion to their cost; a child that gets
several devices is split the same way. Modules sharing a parameter (tied weights) are then put
with the first of them to run. The result is a plain {module name: partition} dict, which pp_rank 0
broadcasts so every rank applies the same decision.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch
import torch.nn as nn
from torch.nn.modules import module as _module_mod

from smshim.modelparallel.torch.errors import InvalidPartitionIDError, SMPValidationError
from smshim.modelparallel.torch.state import state

logger = logging.getLogger(__name__)

# ---- manual assignment ----------------------------------------------------------------------

_marks: "weakref.WeakKeyDictionary[nn.Module, int]" = weakref.WeakKeyDictionary()
_context_stack: List[int] = []
_hook_handles: list = []


def _check_id(pid: int, pp_size: Optional[int]) -> None:
    if not isinstance(pid, int) or isinstance(pid, bool) or pid < 0 or (
            pp_size is not None and pid >= pp_size):
        bound = f"[0, {pp_size})" if pp_size is not None else "a non-negative int"
        raise InvalidPartitionIDError(
            f"partition id {pid!r} is invalid: it must be in {bound} (pipeline_parallel_degree)")


def _mark(module: nn.Module) -> None:
    if _context_stack and module not in _marks:
        _marks[module] = _context_stack[-1]


def _on_module_registered(parent, name, submodule):
    if submodule is not None:
        _mark(submodule)


def _on_tensor_registered(module, name, tensor):
    _mark(module)


@contextlib.contextmanager
def partition(index: int) -> Iterator[None]:
    """Modules created (or assigned to a parent) inside go to partition `index`; innermost wins."""
    _check_id(index, state.cfg.pipeline_parallel_degree if state.initialized else None)
    if not _context_stack:
        _hook_handles.extend([
            _module_mod.register_module_module_registration_hook(_on_module_registered),
            _module_mod.register_module_parameter_registration_hook(_on_tensor_registered),
            _module_mod.register_module_buffer_registration_hook(_on_tensor_registered),
        ])
    _context_stack.append(index)
    try:
        yield
    finally:
        _context_stack.pop()
        if not _context_stack:
            for h in _hook_handles:
                h.remove()
            _hook_handles.clear()


def set_partition(module: nn.Module, index: int, recurse: bool = True) -> None:
    """Assign `module` (and, with recurse, its descendants) to partition `index`."""
    _check_id(index, state.cfg.pipeline_parallel_degree if state.initialized else None)
    for m in (module.modules() if recurse else [module]):
        _marks[m] = index


def manual_assignment(root: nn.Module, pp_size: int, default_partition: int) -> Dict[str, int]:
    out = {}
    for name, m in root.named_modules(remove_duplicate=False):
        pid = 0 if m is root else _marks.get(m, default_partition)
        _check_id(pid, pp_size)
        out[name] = pid
    out = _tie_fixup(root, out, order=None)
    _check_nesting(out)
    return out


def ancestors(name: str) -> Iterator[str]:
    """The names of a module's ancestors below the root, nearest first."""
    while "." in name:
        name = name.rpartition(".")[0]
        yield name


def nested_call_edges(assignment: Dict[str, int]) -> set:
    """(caller, callee) pp ranks of the calls a module on a rank other than 0 may make from
    inside its forward: to a descendant placed on another rank."""
    return {(caller, callee) for name, callee in assignment.items()
            for caller in (assignment.get(a, 0) for a in ancestors(name))
            if caller not in (0, callee)}


def _check_nesting(assignment: Dict[str, int], auto: bool = False) -> None:
    """A module on another rank than 0 may call modules on other ranks from inside its forward
    (a nested call), pp_rank 0's included; but a module on pp_rank 0 called so may not call on
    to modules on other ranks in turn (pp_rank 0 sends its calls as asynchronous handles, which
    a nested call's caller cannot follow). The automatic partition places a module's children
    on its own rank or later ones, so it produces such a placement only when a module that
    shares a parameter with one on pp_rank 0 follows it there (`_tie_fixup`)."""
    for inner0, rank in assignment.items():
        if rank != 0 or not inner0:
            continue
        outer = next((a for a in ancestors(inner0) if assignment.get(a, 0) != 0), None)
        if outer is None:
            continue
        deeper = next((n for n, r in assignment.items()
                       if n.startswith(inner0 + ".") and r != 0), None)
        if deeper is not None:
            why = (" (it shares a parameter with a module there)" if auto else "")
            fix = ("partition it by hand (auto_partition: False, smp.set_partition) with "
                   f"'{deeper}' on pp rank 0 like '{inner0}'" if auto else
                   f"place '{inner0}' on pp rank {assignment[outer]}, or '{deeper}' on pp rank 0 "
                   "(smp.set_partition)")
            raise SMPValidationError(
                f"{'automatic' if auto else 'manual'} partition: module '{inner0}' is on pp "
                f"rank 0{why} inside '{outer}' (pp rank {assignment[outer]}), and its "
                f"descendant '{deeper}' is on pp rank {assignment[deeper]}: a module on pp rank "
                "0 called from inside a module on another rank cannot call modules on other "
                f"ranks in turn. To train this model, {fix}")


# ---- tracing --------------------------------------------------------------------------------

@dataclass
class ModuleTrace:
    order: int = -1  # first execution; -1: never ran in the traced microbatch
    calls: int = 0
    activation_bytes: int = 0
    seconds: float = 0.0


@dataclass
class Trace:
    modules: Dict[str, ModuleTrace] = field(default_factory=dict)


def _tensor_bytes(obj) -> int:
    leaves = torch.utils._pytree.tree_leaves(obj)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


def trace_modules(root: nn.Module, run: Callable[[], None], times: bool) -> Trace:
    """Run `run()` (one microbatch's forward) with hooks on every module of `root`."""
    tr = Trace({name: ModuleTrace() for name, _ in root.named_modules()})
    names = {id(m): name for name, m in root.named_modules()}
    counter = [0]
    starts: Dict[int, List[float]] = {}
    handles = []

    def pre(mod, args):
        rec = tr.modules[names[id(mod)]]
        if rec.order < 0:
            rec.order = counter[0]
            counter[0] += 1
        rec.calls += 1
        if times:
            starts.setdefault(id(mod), []).append(time.perf_counter())

    def post(mod, args, output):
        rec = tr.modules[names[id(mod)]]
        rec.activation_bytes += _tensor_bytes(output)
        if times:
            rec.seconds += time.perf_counter() - starts[id(mod)].pop()

    for m in root.modules():
        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(post))
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return tr


# ---- automatic assignment -------------------------------------------------------------------

def _subtree_costs(root: nn.Module, trace: Trace, memory_weight: float, times: bool) -> Dict[str, float]:
    """Normalised cost of each module's whole subtree."""
    mem: Dict[str, float] = {}
    comp: Dict[str, float] = {}

    def visit(name: str, m: nn.Module, seen: set) -> None:
        own_params = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        seen.update(id(p) for p in own_params)
        pbytes = sum(p.numel() * p.element_size() for p in own_params)
        rec = trace.modules.get(name, ModuleTrace())
        # A module's activations are its outputs; the subtree sum is taken below.
        mem[name] = 3.0 * pbytes + rec.activation_bytes
        comp[name] = rec.seconds if times else float(rec.activation_bytes + pbytes)
        for cname, child in m.named_children():
            visit(f"{name}.{cname}" if name else cname, child, seen)

    visit("", root, set())
    # Subtree totals (children's names extend the parent's with a dot).
    names = sorted(mem, key=lambda n: -n.count("."))
    sub_mem, sub_comp = dict(mem), dict(comp)
    for n in names:
        if n:
            parent = n.rsplit(".", 1)[0] if "." in n else ""
            sub_mem[parent] += sub_mem[n]
            sub_comp[parent] += sub_comp[n]
    tm, tc = sub_mem[""] or 1.0, sub_comp[""] or 1.0
    return {n: memory_weight * sub_mem[n] / tm + (1 - memory_weight) * sub_comp[n] / tc for n in mem}


def split_contiguous(costs: Sequence[float], k: int) -> List[int]:
    """Cut `costs` into k contiguous non-empty groups minimising the largest group sum.
    Returns the group sizes (dynamic programming; sequences here are short)."""
    n = len(costs)
    k = max(1, min(k, n))
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    INF = float("inf")
    best = [[INF] * (n + 1) for _ in range(k + 1)]
    cut = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for g in range(1, k + 1):
        for i in range(g, n + 1):
            for j in range(g - 1, i):
                v = max(best[g - 1][j], prefix[i] - prefix[j])
                if v < best[g][i]:
                    best[g][i], cut[g][i] = v, j
    sizes, i = [], n
    for g in range(k, 0, -1):
        j = cut[g][i]
        sizes.append(i - j)
        i = j
    return sizes[::-1]


def proportional_devices(costs: Sequence[float], devices: int) -> List[int]:
    """Give each group at least one device and the rest in proportion to cost (largest remainder)."""
    n = len(costs)
    extra = devices - n
    total = sum(costs) or 1.0
    shares = [extra * c / total for c in costs]
    alloc = [1 + int(s) for s in shares]
    rest = devices - sum(alloc)
    for i in sorted(range(n), key=lambda i: shares[i] - int(shares[i]), reverse=True)[:rest]:
        alloc[i] += 1
    return alloc


def auto_assignment(root: nn.Module, trace: Trace, pp_size: int, memory_weight: float,
                    times: bool) -> Dict[str, int]:
    cost = _subtree_costs(root, trace, memory_weight, times)
    out: Dict[str, int] = {}

    first_run: Dict[str, int] = {}  # a module's, or else its earliest descendant's, first call
    for name, rec in trace.modules.items():
        if rec.order < 0:
            continue
        parts = name.split(".") if name else []
        for i in range(len(parts) + 1):
            prefix = ".".join(parts[:i])
            first_run[prefix] = min(first_run.get(prefix, rec.order), rec.order)

    def order_of(name: str) -> int:
        return first_run.get(name, 1 << 30)  # never ran: last

    def assign_all(name: str, m: nn.Module, device: int) -> None:
        for sub, _ in m.named_modules(prefix=name, remove_duplicate=False):
            out.setdefault(sub, device)

    def units_of(name: str, m: nn.Module) -> List[tuple]:
        """`m`'s children in execution order, with containers that are never called themselves
        (ModuleList, ModuleDict, ...) replaced by their own children: the forward that indexes
        into a container calls its members one by one, so they are the units to split."""
        units = []
        for c, child in m.named_children():
            cname = f"{name}.{c}" if name else c
            ran = trace.modules.get(cname, ModuleTrace()).order >= 0
            if not ran and any(True for _ in child.children()):
                units.extend(units_of(cname, child))
            else:
                units.append((cname, child))
        units.sort(key=lambda u: order_of(u[0]))
        return units

    def assign(units: List[tuple], devices: List[int]) -> None:
        """`units`: (name, module) siblings in execution order; `devices`: pp ranks to use."""
        if len(devices) == 1 or not units:
            for name, m in units:
                assign_all(name, m, devices[0])
            return
        if len(units) == 1:
            name, m = units[0]
            out[name] = devices[0]  # the module's own forward and parameters
            children = units_of(name, m)
            if children:
                assign(children, devices)
            return
        sizes = split_contiguous([cost[n] for n, _ in units], len(devices))
        groups, i = [], 0
        for s in sizes:
            groups.append(units[i:i + s])
            i += s
        alloc = proportional_devices([sum(cost[n] for n, _ in g) for g in groups], len(devices))
        d = 0
        for g, a in zip(groups, alloc):
            assign(g, devices[d:d + a])
            d += a

    assign([("", root)], list(range(pp_size)))
    out[""] = 0
    # Containers that were flattened away go with their first member (they hold nothing);
    # innermost first, so a container of containers sees its members' places.
    for name, m in reversed(list(root.named_modules(remove_duplicate=False))):
        if name not in out:
            members = [f"{name}.{c}" for c, _ in m.named_children()]
            out[name] = min((out[c] for c in members if c in out), default=0)
    out = _tie_fixup(root, out, order=lambda n: order_of(n))
    _check_nesting(out, auto=True)
    return out


def _tie_fixup(root: nn.Module, assignment: Dict[str, int], order) -> Dict[str, int]:
    """Modules that share a parameter go where the first of them (in execution order) is."""
    owners: Dict[int, List[str]] = {}
    for name, m in root.named_modules(remove_duplicate=False):
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(name)
    for names in owners.values():
        if len(set(names)) < 2:
            continue
        if len({assignment[n] for n in names}) == 1:
            continue
        if order is None:
            places = ", ".join(f"'{n or '<root>'}' on partition {assignment[n]}" for n in names)
            raise ValueError(
                f"modules sharing a parameter must be on one partition, but {places}: "
                "assign them to the same partition")
        first = min(names, key=order)
        for n in names:
            assignment[n] = assignment[first]
    return assignment
