"""The import graph of the library has no circles: neither between modules (typing-only and
function-level imports included: a module that names another's types knows it) nor between the
parts of the architecture (the folders, with the model-parallel face split into its ground
modules and its API), so that in a drawing of the parts every import points down or sideways."""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, List, Set

ROOT = pathlib.Path(__file__).resolve().parent.parent / "smshim"
MP = "smshim.modelparallel.torch"
# The face's ground: what every part of model parallelism stands on.
GROUND = {f"{MP}.{m}" for m in ("errors", "config", "topology", "state", "comm")}


def _modules() -> Dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _edges(mods: Dict[str, pathlib.Path]) -> Dict[str, Set[str]]:
    edges: Dict[str, Set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: List[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")
                    up = up[: len(up) - (node.level - 1)] if node.level > 1 else up
                    base = ".".join(up) + (f".{node.module}" if node.module else "")
                for alias in node.names:
                    sub = f"{base}.{alias.name}"
                    targets.append(sub if sub in mods else base)
            for target in targets:
                # `import a.b.c` or a name in a module: the deepest module of ours it names.
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != mod:
                    edges[mod].add(target)
    return edges


def _part(mod: str) -> str:
    if mod in GROUND:
        return f"{MP} (ground)"
    if mod.startswith(MP + "."):
        rest = mod[len(MP) + 1:].split(".")
        if len(rest) > 1 and rest[0] != "nn":
            return f"{MP}.{rest[0]}"
        return f"{MP} (API)"
    if mod == MP:
        return f"{MP} (API)"
    parts = mod.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def _cycles(edges: Dict[str, Set[str]]) -> List[List[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on: Set[str] = set()
    out: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def _explain(edges: Dict[str, Set[str]], comp: List[str]) -> str:
    members = set(comp)
    return "\n".join(f"  {a} -> {b}" for a in comp for b in sorted(edges[a]) if b in members)


def test_no_module_import_circles():
    edges = _edges(_modules())
    cycles = _cycles(edges)
    assert not cycles, "import circles between modules:\n" + "\n\n".join(
        _explain(edges, c) for c in cycles)


def test_no_circles_between_parts():
    mod_edges = _edges(_modules())
    parts: Dict[str, Set[str]] = {}
    why: Dict[tuple, str] = {}
    for a, targets in mod_edges.items():
        pa = _part(a)
        parts.setdefault(pa, set())
        for b in targets:
            pb = _part(b)
            if pb != pa:
                parts[pa].add(pb)
                why.setdefault((pa, pb), f"{a} -> {b}")
    cycles = _cycles(parts)
    assert not cycles, "import circles between parts:\n" + "\n\n".join(
        "\n".join(f"  {why[(a, b)]}" for a in c for b in sorted(parts[a]) if b in c)
        for c in cycles)


def test_the_check_sees_a_circle():
    # The detector itself: a two-module circle and one through a typing-only import.
    assert _cycles({"a": {"b"}, "b": {"a"}}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": set()}) == []
