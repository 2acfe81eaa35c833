"""The structure the features build on: one resolution of a layout, one step engine, modules in their rooms.

Read from the source, no process started: each test names the rule and the place that breaks it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import lightning_moe

PACKAGE = Path(lightning_moe.__file__).resolve().parent
# The torch side of the layout: ParallelDims holds a layout's sizes before the world size is known.
LAYOUT_FACES = {"layout.py", "parallel/dims.py"}
DIM_SIZE = re.compile(r"\b(tp|cp|ep|pp|mesh_ep|non_dp\w*)\b")


def _sources() -> dict[str, tuple[str, ast.Module]]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        out[path.relative_to(PACKAGE).as_posix()] = (text, ast.parse(text))
    return out


SOURCES = _sources()


def test_no_module_but_layout_infers_dp_or_the_unfolded_ep():
    """dp is the world size over a product of dim sizes; only ``layout.resolve_layout`` divides it out."""
    found = []
    for name, (text, tree) in SOURCES.items():
        if name == "layout.py":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
                left = ast.get_source_segment(text, node.left) or ""
                right = ast.get_source_segment(text, node.right) or ""
                if re.search(r"world|devices", left) and len(set(DIM_SIZE.findall(right))) >= 2:
                    found.append(f"{name}:{node.lineno}: {ast.get_source_segment(text, node)}")
            if isinstance(node, ast.Call) and name not in LAYOUT_FACES:
                func = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                if func in ("unfolded_ep", "default_etp", "hsdp_sizes"):
                    found.append(f"{name}:{node.lineno}: {func}(...) (ask resolve_layout)")
    assert not found, "\n".join(found)


def test_the_strategy_has_no_branch_on_pp():
    """The step engine is chosen once (``choose_step_engine``); the strategy's hooks never ask for pp."""
    text, tree = SOURCES["strategy.py"]
    reads = [
        f"strategy.py:{n.lineno}: {ast.get_source_segment(text, n)}"
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute) and n.attr in ("pp", "pp_group")
    ]
    assert not reads, "\n".join(reads)


def test_data_modules_write_no_trainer_attribute():
    """The step engine alone sets ``trainer.accumulate_grad_batches``; data modules ask it."""
    found = []
    for name, (text, tree) in SOURCES.items():
        if not name.startswith("data/"):
            continue
        for node in ast.walk(tree):
            targets = (
                node.targets
                if isinstance(node, ast.Assign)
                else [node.target]
                if isinstance(node, (ast.AugAssign, ast.AnnAssign))
                else []
            )
            for target in targets:
                if isinstance(target, ast.Attribute) and "trainer" in (
                    ast.get_source_segment(text, target.value) or ""
                ):
                    found.append(f"{name}:{node.lineno}: {ast.get_source_segment(text, target)}")
    assert not found, "\n".join(found)


def test_no_loose_top_level_module():
    """Top-level files are the entry points, ``layout.py``, the package's face and ``dry_run.py`` (``plan``'s
    build on fake ranks, above both ``parallel/`` and ``planner/``); the rest lives in a package."""
    allowed = {"__init__.py", "layout.py", "strategy.py", "train.py", "report.py", "plan.py", "dry_run.py"}
    loose = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in allowed)
    assert not loose, f"modules outside a package: {loose}"


def _package_imports() -> dict[str, set[str]]:
    """Top-level unit (package or module) -> the units it imports at module level."""
    graph: dict[str, set[str]] = {}
    for name, (_, tree) in SOURCES.items():
        unit = name.split("/")[0].removesuffix(".py")
        deps = graph.setdefault(unit, set())
        for node in tree.body:
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_moe."):
                deps.add(node.module.split(".")[1])
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[1] for a in node.names if a.name.startswith("lightning_moe."))
        deps.discard(unit)
    return graph


def test_no_import_cycle_between_packages():
    graph = _package_imports()
    cycles = []

    def visit(unit: str, path: list[str]) -> None:
        for dep in sorted(graph.get(unit, ())):
            if dep in path:
                cycles.append(" -> ".join(path[path.index(dep) :] + [dep]))
            elif dep != "__init__":
                visit(dep, path + [dep])

    for unit in graph:
        visit(unit, [unit])
    assert not cycles, sorted(set(cycles))


# Packages none of whose modules may lie on an import circle: the whole library.
ACYCLIC_PACKAGES = ("lightning_moe",)


def _module_name(path: str) -> str:
    """``planner/comm/tp.py`` -> ``lightning_moe.planner.comm.tp``; a package's ``__init__.py`` is the package."""
    parts = ["lightning_moe", *path.removesuffix(".py").split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_imports() -> dict[str, set[str]]:
    """Module -> the package's modules it imports, at module level and inside functions alike.
    ``from package import name`` imports the submodule ``package.name`` where there is one, else the
    package's ``__init__``; importing a submodule does not count as importing its parents."""
    modules = {_module_name(name): (name, tree) for name, (_, tree) in SOURCES.items()}
    graph: dict[str, set[str]] = {}
    for module, (name, tree) in modules.items():
        package = module if name.endswith("__init__.py") else module.rpartition(".")[0]
        deps = graph.setdefault(module, set())
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: the importing module's package, one level up per dot past the first
                    parts = package.split(".")
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join([*parts, base] if base else parts)
                targets = [f"{base}.{alias.name}" for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in modules:  # "lightning_moe.x.attr" -> the module holding attr
                    target = target.rpartition(".")[0]
                if target and target != module:
                    deps.add(target)
    return graph


def _import_circles(graph: dict[str, set[str]]) -> list[tuple[set[str], list[str]]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each with one
    circle through it: the shortest from its first module back to it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for dep in sorted(graph[node]):
            if dep not in index:
                connect(dep)
                low[node] = min(low[node], low[dep])
            elif dep in stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = {stack.pop()}
            while node not in component:
                component.add(stack.pop())
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return [(component, _shortest_circle(min(component), component, graph)) for component in components]


def _shortest_circle(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """``[start, ..., start]``: the fewest imports leading from ``start`` back to it inside ``component``."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for dep in sorted(graph[node] & component):
                if dep == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if dep not in came_from:
                    came_from[dep] = node
                    following.append(dep)
        frontier = following
    raise AssertionError(f"{start} lies on no circle of {sorted(component)}")


def test_no_import_circle_among_modules():
    """No module of :data:`ACYCLIC_PACKAGES` lies on a circle of imports, whether the imports sit at
    module level or inside functions: a function-level import holds the modules together as firmly,
    it only defers the import to the first call."""
    graph = _module_imports()
    assert {"lightning_moe.planner.comm.ep", "lightning_moe.moe.dispatchers"} <= set(graph), "the scan found no modules"
    found = [
        f"{' -> '.join(circle)} (the circle's component: {', '.join(sorted(component))})"
        for component, circle in _import_circles(graph)
        if any(m == p or m.startswith(p + ".") for m in component for p in ACYCLIC_PACKAGES)
    ]
    assert not found, "\n".join(found)


def test_lower_layers_import_nothing_above_them():
    """layout sits at the bottom, moe/ and cp/ are pure torch, parallel/ works on any module
    (docs/architecture.md, "Layers")."""
    graph = _package_imports()
    above = {
        "layout": set(graph) - {"layout"},
        "_compat": set(graph) - {"_compat"},
        "moe": {
            "parallel",
            "strategy",
            "callbacks",
            "models",
            "hf",
            "data",
            "train",
            "plan",
            "dry_run",
            "verify",
            "report",
            "checkpoint",
            "cp",
        },
        "cp": {
            "parallel",
            "strategy",
            "callbacks",
            "models",
            "hf",
            "data",
            "train",
            "plan",
            "dry_run",
            "verify",
            "report",
            "checkpoint",
            "moe",
        },
        "comm": {
            "parallel",
            "strategy",
            "callbacks",
            "models",
            "hf",
            "data",
            "train",
            "plan",
            "dry_run",
            "verify",
            "report",
            "moe",
            "cp",
        },
        "parallel": {"strategy", "callbacks", "models", "hf", "data", "train", "plan", "dry_run", "verify", "report"},
    }
    upward = {unit: sorted(graph[unit] & banned) for unit, banned in above.items() if graph[unit] & banned}
    assert not upward, upward


def _imported_modules(name: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The dotted names an import statement of module ``name`` (a path under the package) may load:
    ``from a import b`` loads ``a`` and, when ``b`` is a module, ``a.b``; relative imports resolved."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    package = ["lightning_moe", *name.removesuffix(".py").split("/")[:-1]]
    base = ".".join(package[: len(package) - node.level + 1] + [node.module or ""]) if node.level else node.module or ""
    base = base.rstrip(".")
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def test_parallel_imports_no_planner():
    """``parallel/`` works on any module and knows no cost model: none of its modules imports
    ``lightning_moe.planner``, at module level, inside a function or for type checking alone.
    ``layout="auto"`` is resolved in ``strategy.py`` and the dry run is ``dry_run.py``, above both."""
    found = []
    for name, (_, tree) in SOURCES.items():
        if not name.startswith("parallel/"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                hits = [
                    m
                    for m in _imported_modules(name, node)
                    if m == "lightning_moe.planner" or m.startswith("lightning_moe.planner.")
                ]
                found.extend(f"{name}:{node.lineno}: imports {m}" for m in hits[:1])
    assert not found, "\n".join(found)


# The kinds of parallel/ (its __init__.py describes them) and the kinds each may import besides itself
# and dims.py, the ground all stand on: imports point one way, config -> plans <- engines -> runtime.
PARALLEL_KINDS = {"dims": set(), "plans": set(), "runtime": set(), "engines": {"plans", "runtime"}, "config": {"plans"}}


def test_the_kinds_of_parallel_import_one_way():
    """Every module of ``parallel/`` is of one kind (a subpackage, or ``dims.py``) and imports, at any
    level, only the kinds ``PARALLEL_KINDS`` allows it, and never the face ``lightning_moe.parallel``."""
    found = []
    for name, (_, tree) in SOURCES.items():
        if not name.startswith("parallel/") or name == "parallel/__init__.py":
            continue
        kind = name.split("/")[1].removesuffix(".py")
        if kind not in PARALLEL_KINDS:
            found.append(f"{name}: of no kind of parallel/ (a module belongs in one of {sorted(PARALLEL_KINDS)})")
            continue
        allowed = PARALLEL_KINDS[kind] | {kind, "dims"}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            modules = _imported_modules(name, node)
            if "lightning_moe.parallel" in modules:
                found.append(f"{name}:{node.lineno}: imports the face lightning_moe.parallel")
                continue
            wrong = [m for m in modules if m.startswith("lightning_moe.parallel.") and m.split(".")[2] not in allowed]
            found.extend(f"{name}:{node.lineno}: {kind} imports {m}" for m in wrong[:1])
    assert not found, "\n".join(found)


# Documents outside the repository that nothing may cite: the strings are assembled here so that this
# file does not name them itself.
ROOT = PACKAGE.parent
_OUTSIDE = re.compile("|".join((
    "DESIGN" + r"\.md",
    "DESIGN" + r"\s*§",
    "DESIGN" + r"\s+sections?\b",
    r"\bshared" + "/",
    "PLATFORM" + "_NOTES",
)))  # fmt: skip
CITING_ROOTS = (
    "README.md",
    "docs",
    "lightning_moe",
    "tests",
    "experiments",
    "conf",
    "Makefile",
    "pyproject.toml",
    ".ci",
)


def _project_files() -> list[Path]:
    """Every text file of the project's docs, package, tests, experiments, configs and build files
    (``conf`` is followed where it links into the package; caches and binary files are left out)."""
    seen: dict[Path, Path] = {}
    for name in CITING_ROOTS:
        root = (ROOT / name).resolve()
        for path in [root] if root.is_file() else sorted(root.rglob("*")):
            if path.is_file() and "__pycache__" not in path.parts:
                seen.setdefault(path.resolve(), path)
    return sorted(seen)


def test_nothing_cites_a_document_outside_the_repository():
    """Citations point into the repository (docs/architecture.md for the architecture); a file outside
    it is missing from every clone and installed package."""
    files, found = _project_files(), []
    for path in files:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            match = _OUTSIDE.search(line)
            if match:
                found.append(f"{path.relative_to(ROOT)}:{number}: {match.group(0)!r} in {line.strip()[:100]}")
    assert any(p.name == "architecture.md" for p in files) and len(files) > 100, "the scan found no project files"
    assert not found, "\n".join(found)


# One home per variant: the dispatcher kinds and the cp_comm kinds are named in their home module only;
# everything else asks the enum (``DispatcherKind``, ``CpComm``) or the capability table.
VARIANT_HOMES = {"moe/dispatchers.py": "DispatcherKind", "cp/comm.py": "CpComm"}


def _variant_values() -> dict[str, str]:
    from lightning_moe.cp.comm import CpComm
    from lightning_moe.moe.dispatchers import DispatcherKind

    values = {k.value: "moe/dispatchers.py" for k in DispatcherKind}
    values.update({k.value: "cp/comm.py" for k in CpComm})
    return values


def test_dispatcher_and_cp_comm_kinds_are_spelled_in_their_home_only():
    """No string literal equal to a dispatcher kind ("alltoall", ...) or a cp_comm kind ("ring", "a2a")
    outside ``moe/dispatchers.py`` and ``cp/comm.py`` (docstrings and comments aside; Hydra YAML is
    configuration, not code)."""
    values = _variant_values()
    assert set(values.values()) == set(VARIANT_HOMES)
    found = []
    for name, (text, tree) in SOURCES.items():
        docstrings = {
            id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)
        }
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Constant) and isinstance(node.value, str)) or id(node) in docstrings:
                continue
            home = values.get(node.value)
            if home is None or home == name:
                continue
            found.append(f"{name}:{node.lineno}: {node.value!r} (ask {VARIANT_HOMES[home]} in {home})")
    assert not found, "\n".join(found)
