"""Private APIs live in lightning_moe/_compat.py only, and the version floors it states are enforced."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest

import lightning_moe
from lightning_moe import _compat

PACKAGE = Path(lightning_moe.__file__).resolve().parent
# Underscore names that are public by contract: namedtuple's API, Hydra's `_target_` key, and
# `os._exit` (documented in the os module: exit without cleanup handlers).
PUBLIC_UNDERSCORE = {"_replace", "_asdict", "_fields", "_make", "_target_", "_exit"}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__") and name not in PUBLIC_UNDERSCORE


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(tree: ast.AST, module: str) -> dict[str, str]:
    """Every name the file binds by an import (at any depth), as ``name -> dotted path``."""
    names: dict[str, str] = {}
    package = module if module.endswith("__init__") else module.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                names[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else alias.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                names[alias.asname or alias.name] = f"{base}.{alias.name}"
    return names


def _resolve(dotted: str) -> Any:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            obj = getattr(obj, part)
        return obj
    raise ImportError(dotted)


def _foreign_private_names(bases: list[Any]) -> set[str]:
    """Private names that the non-lightning-moe classes among ``bases``' MROs define or set on ``self``."""
    names: set[str] = set()
    for base in bases:
        for cls in inspect.getmro(base):
            if cls is object or cls.__module__.startswith("lightning_moe"):
                continue
            names.update(n for n in vars(cls) if _private(n))
            try:
                names.update(n for n in re.findall(r"self\.(_\w+)", inspect.getsource(cls)) if _private(n))
            except (OSError, TypeError):
                pass
    return names


class _PrivateUseFinder(ast.NodeVisitor):
    """Private uses in one file: private imports, overrides and ``self._x`` of a foreign base's
    private names, and ``obj._x`` where lightning-moe defines no ``_x`` itself."""

    def __init__(self, path: Path, own_names: set[str]) -> None:
        self.path, self.own_names = path, own_names
        self.module = _module_name(path)
        self.tree = ast.parse(path.read_text())
        self.imports = _imported_names(self.tree, self.module)
        self.foreign: list[set[str]] = [set()]
        self.found: list[str] = []

    def _report(self, node: ast.AST, what: str) -> None:
        self.found.append(f"{self.path.relative_to(PACKAGE)}:{node.lineno}: {what}")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if any(_private(part) for part in alias.name.split(".")):
                self._report(node, f"import {alias.name}")

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and not (node.module or "").startswith("lightning_moe"):
            for alias in node.names:
                if any(_private(part) for part in (node.module or "").split(".")) or _private(alias.name):
                    self._report(node, f"from {node.module} import {alias.name}")

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        bases = []
        for base in node.bases:
            dotted = ast.unparse(base)
            head, _, rest = dotted.partition(".")
            target = self.imports.get(head, f"{self.module}.{head}")
            try:
                obj = _resolve(f"{target}.{rest}" if rest else target)
            except (ImportError, AttributeError):
                continue
            if inspect.isclass(obj):
                bases.append(obj)
        foreign = _foreign_private_names(bases)
        for item in node.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)) and item.name in foreign:
                self._report(item, f"overrides {item.name} of a torch/Lightning base class")
        self.foreign.append(foreign)
        self.generic_visit(node)
        self.foreign.pop()

    def visit_Attribute(self, node: ast.Attribute) -> None:
        name = node.attr
        if _private(name):
            on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            on_super = isinstance(node.value, ast.Call) and ast.unparse(node.value.func) == "super"
            if (on_self or on_super) and name in self.foreign[-1]:
                self._report(node, f"{ast.unparse(node)} (a private attribute of a torch/Lightning base class)")
            elif not (on_self or on_super) and name not in self.own_names:
                self._report(node, ast.unparse(node))
        self.generic_visit(node)


def _own_private_names() -> set[str]:
    """Private names lightning-moe defines: functions, classes, module and local names, ``self._x``."""
    names: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and ast.unparse(node.value) == "self":
                names.add(node.attr)
    return {name for name in names if _private(name)}


def private_api_uses(paths: list[Path]) -> list[str]:
    own = _own_private_names()
    found: list[str] = []
    for path in paths:
        finder = _PrivateUseFinder(path, own)
        finder.visit(finder.tree)
        found += finder.found
    return found


def test_private_apis_are_used_only_through_compat():
    paths = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "_compat.py")
    offenders = private_api_uses(paths)
    assert not offenders, "private API used outside lightning_moe/_compat.py:\n" + "\n".join(offenders)


def test_pipeline_refuses_a_torch_older_than_its_stage_internals(monkeypatch):
    monkeypatch.setattr(_compat.torch, "__version__", "2.10.0+cu128")
    with pytest.raises(RuntimeError, match=r"pipeline parallelism \(pp > 1\) needs torch >= 2.11, found 2.10.0"):
        _compat.require_pipeline_stage_internals()
    for supported in ("2.11.0+cu130", "2.13.0+cpu"):
        monkeypatch.setattr(_compat.torch, "__version__", supported)
        _compat.require_pipeline_stage_internals()


def test_pyproject_floors_match_compat():
    text = (PACKAGE.parent / "pyproject.toml").read_text()
    assert '"torch>=2.11"' in text and '"lightning>=2.6"' in text


# -- the version range each _compat name was checked on ------------------------------------------------
COMPAT_PATH = PACKAGE / "_compat.py"
# "Checked on: torch 2.11-2.13." / "Checked on: lightning 2.6-2.6, torch 2.13-2.13." (floor-ceiling, or one version)
_CHECKED_ON = re.compile(r"Checked on: ((?:[A-Za-z][\w.-]* \d+\.\d+(?:-\d+\.\d+)?)(?:, [A-Za-z][\w.-]* \d+\.\d+(?:-\d+\.\d+)?)*)\.")
_RANGE = re.compile(r"([A-Za-z][\w.-]*) (\d+\.\d+)(?:-(\d+\.\d+))?")


def _compat_docstrings() -> dict[str, str]:
    """Docstring of each top-level name of _compat.py: a def's or class's own, or the string literal
    that follows an assignment or import (an attribute docstring)."""
    body = ast.parse(COMPAT_PATH.read_text()).body
    docs: dict[str, str] = {}
    for node, after in zip(body, [*body[1:], None]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            docs[node.name] = ast.get_docstring(node) or ""
            continue
        if isinstance(node, ast.Assign):
            names = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names = [node.target.id]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [alias.asname or alias.name.split(".")[0] for alias in node.names]
        else:
            continue
        text = after.value.value if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant) else None
        for name in names:
            docs[name] = text if isinstance(text, str) else ""
    return docs


def _minor(version: str) -> tuple[int, int]:
    major, minor = re.match(r"(\d+)\.(\d+)", version).groups()
    return int(major), int(minor)


def checked_on(doc: str) -> dict[str, tuple[str, str]]:
    """``{package: (floor, ceiling)}`` of a docstring's ``Checked on:`` line; {} without one."""
    found = _CHECKED_ON.search(" ".join(doc.split()))
    if found is None:
        return {}
    return {m[1]: (m[2], m[3] or m[2]) for m in _RANGE.finditer(found[1])}


def version_range_problems(docs: dict[str, str], names: list[str], installed: Any) -> list[str]:
    """What is wrong with the ``Checked on:`` lines of ``names``; ``installed(package)`` gives a version."""
    problems: list[str] = []
    for name in names:
        ranges = checked_on(docs.get(name, ""))
        if not ranges:
            problems.append(
                f"{name}: no 'Checked on: <package> <floor>-<ceiling>.' line in its docstring (a string after the"
                " assignment for a constant or module): state the versions its private API was checked on"
            )
        for package, (floor, ceiling) in ranges.items():
            version = installed(package)
            if _minor(version) > _minor(ceiling):
                problems.append(
                    f"{name}: checked on {package} {floor}-{ceiling}, installed {version}: re-check the private API"
                    f" it wraps against {package} {version} and raise the ceiling in its 'Checked on:' line"
                )
            elif _minor(version) < _minor(floor):
                problems.append(
                    f"{name}: checked on {package} {floor}-{ceiling}, installed {version} is below the floor: check the"
                    f" API on {package} {version} and lower the floor (or raise the requirement in pyproject.toml)"
                )
    return problems


def test_every_compat_name_states_the_versions_it_was_checked_on():
    from importlib.metadata import version

    problems = version_range_problems(_compat_docstrings(), list(_compat.__all__), version)
    assert not problems, "lightning_moe/_compat.py:\n" + "\n".join(problems)


def test_a_version_outside_the_checked_range_fails_with_the_way_out():
    docs = {"new": "Wraps x. Checked on: torch 2.11-2.13.", "both": "Checked on: lightning 2.6-2.6, torch\n    2.13-2.13.",
            "single": "Checked on: hydra-core 1.3.", "bare": "Wraps x. Present in torch 2.9."}
    versions = {"torch": "2.13.0+cpu", "lightning": "2.6.6", "hydra-core": "1.3.8"}
    assert version_range_problems(docs, ["new", "both", "single"], versions.get) == []
    assert checked_on(docs["both"]) == {"lightning": ("2.6", "2.6"), "torch": ("2.13", "2.13")}
    [missing] = version_range_problems(docs, ["bare"], versions.get)
    assert "no 'Checked on:" in missing
    [above] = version_range_problems(docs, ["new"], {"torch": "2.14.0"}.get)
    assert "installed 2.14.0" in above and "raise the ceiling" in above
    [below] = version_range_problems(docs, ["both"], {"lightning": "2.6.0", "torch": "2.12.1"}.get)
    assert "below the floor" in below and below.startswith("both: checked on torch 2.13-2.13")
