"""The import layering of the `rankcast` package, checked statically with `ast`.

Layers, lowest first; a module may import from its own layer and from lower ones:

    leaf < rankcast.model < rankcast.lora < rankcast.worker < rankcast.executor
         < rankcast.engine_core < rankcast.engine_client < rankcast.offline
         < rankcast.api_server < rankcast.launcher < rankcast (the facade)

The leaf layer holds every top-level module (rankcast/*.py: config, envs, protocol,
sampling_params, outputs, platform, distributed, logger, process, tokenizer, ...) and the
packages in LEAF_PACKAGES (rankcast.kernels; rankcast.channel: the notification channel is
used by every process, so it may import nothing above the leaves; rankcast.model_files: what
every process reads about a model).

Packages are each one process's code: rankcast.engine_core (the engine-core process),
rankcast.engine_client (inside every API server and the offline LLM), rankcast.api_server (each
API server), rankcast.offline (the user's process), rankcast.launcher (the launcher). The pairs in
SEPARATE may not import each other in either direction: engine_core and engine_client meet only
through rankcast.protocol, so which process a file runs in is never in doubt. The root package
itself (rankcast/__init__.py) re-exports the public API (rankcast.offline's LLM), so it sits above
everything: nothing inside rankcast may import it (`import rankcast`, `from rankcast import
SamplingParams`); `from rankcast import envs` names the submodule rankcast.envs and is fine.
A new subpackage must be placed in a layer here before the test passes.

Every import counts: module level, inside functions, under `if TYPE_CHECKING:`; relative
imports are resolved. Only imports of `rankcast.*` matter. Importing `rankcast.a.b` is an edge
to rankcast.a.b only (not to the parent packages whose `__init__` Python also runs).

Cycles are looked for in two graphs: units (each top-level module or package, e.g.
rankcast.worker -> rankcast.lora) and modules. Every import that is an edge inside a cycle
(a strongly connected component) is reported, so both directions of a two-way dependency show.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE_DIR = REPO / "rankcast"
ROOT = "rankcast"

LEAF = "leaf"
LEAF_PACKAGES = frozenset({"rankcast.kernels", "rankcast.channel", "rankcast.model_files"})
LAYERS = [
    LEAF,
    "rankcast.model",
    "rankcast.lora",
    "rankcast.worker",
    "rankcast.executor",
    "rankcast.engine_core",
    "rankcast.engine_client",
    "rankcast.offline",
    "rankcast.api_server",
    "rankcast.launcher",
    ROOT,  # the facade: rankcast/__init__.py
]

# Units that may not import each other in either direction, whatever their layers.
SEPARATE = frozenset(
    {
        ("rankcast.engine_core", "rankcast.engine_client"),
        ("rankcast.engine_core", "rankcast.api_server"),
        ("rankcast.offline", "rankcast.api_server"),
    }
)

# Known exceptions, as (kind, importer module, imported module); kind: "layer" (imports a
# higher layer), "unit-cycle" (an edge of a cycle between top-level modules/packages),
# "module-cycle" (an edge of a cycle between modules). Keys carry no line numbers, so edits
# elsewhere in a file do not disturb them; the failure shows file:line. Kind "separate": an
# import between the two units of a SEPARATE pair. Empty: the last ones
# went with issue 12. The test also fails when a listed entry no longer occurs, so the list
# can only shrink on purpose.
ALLOWED_TODAY: frozenset[tuple[str, str, str]] = frozenset()


@dataclass(frozen=True)
class Import:
    importer: str  # module name, e.g. rankcast.lora.layers
    imported: str  # module name, e.g. rankcast.worker.sampler
    file: str = "?"  # path relative to the repository
    line: int = 0

    def describe(self) -> str:
        return f"{self.importer} ({self.file}:{self.line}) -> {self.imported}"


# ---- discovery and parsing ----


def discover(package_dir: Path, root: str = ROOT) -> dict[str, Path]:
    """Module name -> file, for every .py file of the package (packages by __init__.py)."""
    modules = {}
    for path in sorted(package_dir.rglob("*.py")):
        rel = path.relative_to(package_dir)
        if "__pycache__" in rel.parts:
            continue
        parts = [root, *rel.parts[:-1]]
        if rel.name != "__init__.py":
            parts.append(rel.stem)
        modules[".".join(parts)] = path
    return modules


def _resolve(name: str, known: set[str]) -> str:
    """`name` if it is a module, else the longest known prefix (an attribute of a module)."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in known:
            return candidate
    return name


def imports_of(
    module: str, source: str, known: set[str], file: str = "?", is_package: bool = False
) -> list[Import]:
    """Every import of `root.*` in `source` (any depth: functions, conditionals)."""
    root = module.split(".")[0]
    package = module.split(".") if is_package else module.split(".")[:-1]
    found = []
    for node in ast.walk(ast.parse(source, filename=file)):
        targets: list[str] = []
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Import):
            targets = [_resolve(alias.name, known) for alias in node.names]
        else:
            if node.level:
                base_parts = package[: len(package) - (node.level - 1)]
                base = ".".join([*base_parts, *([node.module] if node.module else [])])
            else:
                base = node.module or ""
            for alias in node.names:
                # `from pkg import sub` imports the submodule pkg.sub when there is one.
                sub = f"{base}.{alias.name}"
                targets.append(sub if sub in known else _resolve(base, known))
        for target in dict.fromkeys(targets):  # `from m import a, b` is one import of m
            if target == root or target.startswith(root + "."):
                found.append(Import(module, target, file, node.lineno))
    return found


def collect(package_dir: Path = PACKAGE_DIR, root: str = ROOT) -> list[Import]:
    modules = discover(package_dir, root)
    known = set(modules)
    found = []
    for module, path in modules.items():
        found += imports_of(
            module,
            path.read_text(),
            known,
            str(path.relative_to(package_dir.parent)),
            is_package=path.name == "__init__.py",
        )
    return found


# ---- the rules ----


def unit_of(module: str) -> str:
    """The top-level module or package a module belongs to (the root for rankcast itself)."""
    return ".".join(module.split(".")[:2])


def layer_of(module: str, packages: set[str]) -> str | None:
    """The layer of a module; None for a subpackage no layer names yet.

    `packages`: the units that are packages (the rest of the units are top-level modules).
    """
    unit = unit_of(module)
    if unit in LAYERS:
        return unit
    if unit in LEAF_PACKAGES or unit not in packages:
        return LEAF
    return None


def upward_imports(imports: Iterable[Import], packages: set[str]) -> list[Import]:
    rank = {layer: i for i, layer in enumerate(LAYERS)}
    bad = []
    for imp in imports:
        src, dst = layer_of(imp.importer, packages), layer_of(imp.imported, packages)
        if src is not None and dst is not None and rank[dst] > rank[src]:
            bad.append(imp)
    return bad


def strongly_connected(edges: Iterable[tuple[str, str]]) -> list[set[str]]:
    """Components of more than one node, or with a self edge (Tarjan, iterative)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for a, b in edges:
        graph[a].add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1 or node in graph[node]:
                    components.append(component)
    return components


def cycle_imports(
    imports: list[Import], key: Callable[[Import], tuple[str, str]]
) -> list[tuple[frozenset[str], Import]]:
    """(component, import) for every import whose edge `key(import)` lies inside a cycle.

    Edges from a node to itself are left out: a module in its own unit, or a module that
    imports itself."""
    edges = [(imp, *key(imp)) for imp in imports]
    edges = [(imp, a, b) for imp, a, b in edges if a != b]
    found = []
    for component in strongly_connected((a, b) for _, a, b in edges):
        members = frozenset(component)
        found += [(members, imp) for imp, a, b in edges if a in members and b in members]
    return found


def _unit_edge(imp: Import) -> tuple[str, str]:
    return unit_of(imp.importer), unit_of(imp.imported)


def _module_edge(imp: Import) -> tuple[str, str]:
    return imp.importer, imp.imported


def separated_imports(imports: Iterable[Import]) -> list[Import]:
    """Imports from one unit of a SEPARATE pair to the other, either way."""
    pairs = SEPARATE | {(b, a) for a, b in SEPARATE}
    return [imp for imp in imports if (unit_of(imp.importer), unit_of(imp.imported)) in pairs]


def violations(imports: list[Import], packages: set[str]) -> dict[tuple[str, str, str], list[str]]:
    """(kind, importer, imported) -> descriptions of each offending import (file:line)."""
    found: dict[tuple[str, str, str], list[str]] = defaultdict(list)
    for imp in separated_imports(imports):
        found[("separate", imp.importer, imp.imported)].append(imp.describe())
    for imp in upward_imports(imports, packages):
        found[("layer", imp.importer, imp.imported)].append(imp.describe())
    for kind, key in (("unit-cycle", _unit_edge), ("module-cycle", _module_edge)):
        for members, imp in cycle_imports(imports, key):
            cycle = " <-> ".join(sorted(members))
            found[(kind, imp.importer, imp.imported)].append(f"{imp.describe()}  [{cycle}]")
    return dict(found)


def report(
    found: dict[tuple[str, str, str], list[str]], keys: Iterable[tuple[str, str, str]]
) -> str:
    lines = []
    for key in sorted(keys):
        for description in found.get(key, [repr(key)]):
            lines.append(f"  {key[0]}: {description}")
    return "\n".join(lines)


# ---- the tests ----


@pytest.fixture(scope="module")
def rankcast_imports() -> tuple[list[Import], set[str]]:
    """Every rankcast.* import in rankcast/, and the units that are packages."""
    modules = discover(PACKAGE_DIR)
    packages = {
        unit_of(m)
        for m, p in modules.items()
        if m != ROOT and (p.name == "__init__.py" or m != unit_of(m))
    }
    return collect(), packages


def test_every_subpackage_is_placed_in_a_layer(
    rankcast_imports: tuple[list[Import], set[str]],
) -> None:
    imports, packages = rankcast_imports
    unplaced = sorted(p for p in packages if layer_of(p, packages) is None)
    assert not unplaced, f"add to LAYERS or LEAF_PACKAGES in {__file__}: {unplaced}"
    # The walk saw the package: every named layer exists and imports were found in each.
    assert set(LAYERS) - {LEAF} <= packages | {ROOT}
    importers = {layer_of(imp.importer, packages) for imp in imports}
    assert importers == set(LAYERS), set(LAYERS) - importers


def test_no_new_layer_or_cycle_violations_and_none_fixed_silently(
    rankcast_imports: tuple[list[Import], set[str]],
) -> None:
    imports, packages = rankcast_imports
    found = violations(imports, packages)
    new = set(found) - ALLOWED_TODAY
    fixed = ALLOWED_TODAY - set(found)
    message = []
    if new:
        message.append(
            "imports that break the layering (lowest first: "
            + " < ".join(LAYERS)
            + ") or close a cycle:\n"
            + report(found, new)
        )
    if fixed:
        message.append(
            "fixed, so remove these from ALLOWED_TODAY in tests/test_import_layers.py:\n"
            + "\n".join(f"  {key}" for key in sorted(fixed))
        )
    assert not message, "\n".join(message)


# ---- the checker checks itself ----

SYNTHETIC = [
    # Allowed: same layer, lower layer, function-level import from executor down to worker.
    Import("rankcast.worker.worker", "rankcast.lora.layers", "w.py", 1),
    Import("rankcast.executor.base", "rankcast.worker.worker", "e.py", 2),
    Import("rankcast.config", "rankcast.envs", "c.py", 3),
    # Upward: lora -> worker (also closes the unit cycle lora <-> worker).
    Import("rankcast.lora.layers", "rankcast.worker.sampler", "l.py", 4),
    # Upward: a leaf module -> model.
    Import("rankcast.tokenizer", "rankcast.model.llama", "t.py", 5),
    # Leaf modules in a cycle: layering allows both, the cycle rule does not.
    Import("rankcast.protocol", "rankcast.outputs", "p.py", 6),
    Import("rankcast.outputs", "rankcast.protocol", "o.py", 7),
    # A module cycle inside one package.
    Import("rankcast.engine_core.core", "rankcast.engine_core.core_proc", "a.py", 8),
    Import("rankcast.engine_core.core_proc", "rankcast.engine_core.core", "b.py", 9),
    # Inside rankcast, the facade is above everything.
    Import("rankcast.launcher.cli", "rankcast", "cli.py", 10),
    # The two processes' packages: downward by layer, still refused; upward, refused twice.
    Import("rankcast.engine_client.core_client", "rankcast.engine_core.core", "cc.py", 11),
    Import("rankcast.engine_core.core", "rankcast.engine_client.detokenizer", "ec.py", 12),
    # The channel is a leaf package: it may not reach up into the executor.
    Import("rankcast.channel.gather", "rankcast.executor.base", "g.py", 13),
    # Both process packages may use the channel and the protocol.
    Import("rankcast.engine_client.async_llm", "rankcast.channel.decoder", "al.py", 14),
    Import("rankcast.engine_core.core", "rankcast.protocol", "co.py", 15),
]
SYNTHETIC_PACKAGES = {
    "rankcast.worker",
    "rankcast.lora",
    "rankcast.executor",
    "rankcast.model",
    "rankcast.engine_core",
    "rankcast.engine_client",
    "rankcast.channel",
    "rankcast.entrypoints",
}


def test_the_checker_reports_upward_imports_and_cycles() -> None:
    found = violations(SYNTHETIC, SYNTHETIC_PACKAGES)
    assert set(found) == {
        ("layer", "rankcast.lora.layers", "rankcast.worker.sampler"),
        ("layer", "rankcast.tokenizer", "rankcast.model.llama"),
        ("layer", "rankcast.launcher.cli", "rankcast"),
        ("unit-cycle", "rankcast.lora.layers", "rankcast.worker.sampler"),
        ("unit-cycle", "rankcast.worker.worker", "rankcast.lora.layers"),
        ("unit-cycle", "rankcast.protocol", "rankcast.outputs"),
        ("unit-cycle", "rankcast.outputs", "rankcast.protocol"),
        ("module-cycle", "rankcast.protocol", "rankcast.outputs"),
        ("module-cycle", "rankcast.outputs", "rankcast.protocol"),
        ("module-cycle", "rankcast.engine_core.core", "rankcast.engine_core.core_proc"),
        ("module-cycle", "rankcast.engine_core.core_proc", "rankcast.engine_core.core"),
        ("separate", "rankcast.engine_client.core_client", "rankcast.engine_core.core"),
        ("separate", "rankcast.engine_core.core", "rankcast.engine_client.detokenizer"),
        ("layer", "rankcast.engine_core.core", "rankcast.engine_client.detokenizer"),
        ("unit-cycle", "rankcast.engine_client.core_client", "rankcast.engine_core.core"),
        ("unit-cycle", "rankcast.engine_core.core", "rankcast.engine_client.detokenizer"),
        ("layer", "rankcast.channel.gather", "rankcast.executor.base"),
        # No module cycle for lora <-> worker: worker.sampler does not import worker.worker.
    }
    assert found[("layer", "rankcast.lora.layers", "rankcast.worker.sampler")] == [
        "rankcast.lora.layers (l.py:4) -> rankcast.worker.sampler"
    ]
    # And the gate itself: one new violation on top of the allowed ones fails.
    allowed = set(found) - {("layer", "rankcast.tokenizer", "rankcast.model.llama")}
    assert set(found) - allowed == {("layer", "rankcast.tokenizer", "rankcast.model.llama")}


def test_the_parser_resolves_relative_and_nested_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "rankcast"
    for rel, source in {
        "__init__.py": "from rankcast.sub.mod import thing\n",
        "envs.py": "",
        "sub/__init__.py": "from . import mod\nfrom .mod import thing\n",
        "sub/mod.py": """
            import os
            import rankcast.envs
            from rankcast import envs
            from .. import envs as e2
            from ..envs import VALUE
            from .other import name, sibling_fn

            def late():
                from rankcast.deep.leaf import f
                if True:
                    import rankcast.deep
        """,
        "sub/other.py": "",
        "deep/__init__.py": "",
        "deep/leaf.py": "try:\n    from ..sub import other\nexcept ImportError:\n    pass\n",
    }.items():
        path = pkg / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    got = {(i.importer, i.imported, i.line) for i in collect(pkg)}
    assert got == {
        ("rankcast", "rankcast.sub.mod", 1),
        ("rankcast.sub", "rankcast.sub.mod", 1),
        ("rankcast.sub", "rankcast.sub.mod", 2),
        ("rankcast.sub.mod", "rankcast.envs", 3),
        ("rankcast.sub.mod", "rankcast.envs", 4),
        ("rankcast.sub.mod", "rankcast.envs", 5),
        ("rankcast.sub.mod", "rankcast.envs", 6),
        ("rankcast.sub.mod", "rankcast.sub.other", 7),
        ("rankcast.sub.mod", "rankcast.deep.leaf", 10),
        ("rankcast.sub.mod", "rankcast.deep", 12),
        ("rankcast.deep.leaf", "rankcast.sub.other", 2),
    }
    # `rankcast.deep` is a package that no layer names.
    assert layer_of("rankcast.deep.leaf", {"rankcast.sub", "rankcast.deep"}) is None
    assert layer_of("rankcast.envs", {"rankcast.sub", "rankcast.deep"}) == LEAF


# ---- the Rust side: no module cycle in any crate of rust/ ----

RUST = REPO / "rust"
_CRATE_PATH = re.compile(r"(?<![\w$])crate::(?:\{([^}]*)\}|(\w+))")


def rust_module_edges(src: Path) -> set[tuple[str, str]]:
    """(module, module) for every `crate::<module>` path one file of a crate's `src/` uses,
    comments left out. The crate root (lib.rs, main.rs) is not a node: it declares every
    module, and what it defines for all of them (macros, shared types) closes no cycle."""
    modules = {p.stem for p in src.glob("*.rs")} - {"lib", "main"}
    edges = set()
    for path in src.glob("*.rs"):
        if path.stem not in modules:
            continue
        code = "\n".join(line.split("//")[0] for line in path.read_text().splitlines())
        for group, single in _CRATE_PATH.findall(code):
            names = (
                [part.strip().split("::")[0] for part in group.split(",")] if group else [single]
            )
            edges |= {(path.stem, name) for name in names if name in modules and name != path.stem}
    return edges


def test_no_rust_crate_has_a_module_cycle() -> None:
    crates = sorted(p for p in RUST.glob("*/src") if p.is_dir())
    assert len(crates) >= 4, crates  # wire, client, text, frontend
    cycles = {
        src.parent.name: sorted(sorted(c) for c in strongly_connected(rust_module_edges(src)))
        for src in crates
    }
    assert not any(cycles.values()), f"module cycles in rust/: {cycles}"


def test_the_rust_edge_reader_sees_grouped_and_single_paths(tmp_path: Path) -> None:
    (tmp_path / "lib.rs").write_text("mod a;\nmod b;\nmod c;\n")
    (tmp_path / "a.rs").write_text("use crate::{b::X, Dict};\n// crate::c in a comment\n")
    (tmp_path / "b.rs").write_text("fn f() { crate::a::g(); $crate::c::h(); }\n")
    (tmp_path / "c.rs").write_text("")
    assert rust_module_edges(tmp_path) == {("a", "b"), ("b", "a")}
    assert strongly_connected(rust_module_edges(tmp_path)) == [{"a", "b"}]
