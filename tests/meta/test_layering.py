"""Imports flow one way: the package tree is the pipeline, lower layers never import higher ones, no cycles.

Layers, lowest first (a module may import its own package and any lower layer, never a higher one):

    utils < targets < data < cache < losses < decoding < drafters < calibration < training < planning
          < evaluation < export < benchmarks < (deepspec.cli, deepspec.pipeline, deepspec.gpu_check)

Decoding holds the primitives every drafter builds on (proposal type, sampler, draft KV cache, acceptance,
verifier, loops, scheduler) and never imports a drafter; drafter kinds import them to build their proposers.
Every import counts, also the ones inside functions (a lazy import is still a dependency), and on top of the
layer order there is no import cycle between modules.
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "deepspec"

LAYERS = ["utils", "targets", "data", "cache", "losses", "decoding", "drafters", "calibration", "training",
          "planning", "evaluation", "export", "benchmarks", "cli", "pipeline"]
RANK = {name: rank for rank, name in enumerate(LAYERS)}
RANK["cli"] = RANK["pipeline"]  # the two top-level entry modules share the top layer
RANK["gpu_check"] = RANK["pipeline"]  # so does the GPU check, which drives every stage's entry points
RANK["conf"] = -1  # packaged YAML only


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, modules: set[str]) -> set[str]:
    """Every deepspec module `path` imports (function-level imports too; relative ones resolved).

    `from pkg import name` depends on the module `pkg.name` when that is a module, else on `pkg` itself.
    """
    tree = ast.parse(path.read_text())
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {name for name in found if name in modules}


def _graph() -> dict[str, set[str]]:
    paths = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: _imports(path, set(paths)) - {name} for name, path in paths.items()}


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "deepspec"


def test_no_import_from_a_higher_layer():
    problems = []
    for module, imported in _graph().items():
        layer = _layer(module)
        if layer == "deepspec":
            continue
        for target in imported:
            other = _layer(target)
            if other not in ("deepspec", layer) and RANK[other] > RANK[layer]:
                problems.append(f"{module} ({layer}) imports {target} ({other}, a higher layer)")
    assert not problems, "\n".join(sorted(problems))


def test_every_package_has_a_layer():
    packages = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    modules = {p.stem for p in ROOT.glob("*.py")} - {"__init__"}
    assert packages | modules <= set(RANK), sorted((packages | modules) - set(RANK))


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]

    def visit(node):
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return out


def test_no_import_cycles_between_modules():
    cycles = _cycles(_graph())
    assert not cycles, "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []
