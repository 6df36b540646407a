"""Code fingerprints: a hash of the specgate modules a stage runs, for Snakemake `params:`.

Snakemake reruns a job when its script changes, but not when a library module the
script imports changes. Each rule therefore carries the fingerprint of its entry
module and every specgate module that module imports, transitively. The hash is
taken over the parsed syntax tree, so comments and formatting do not cause reruns.
"""

from __future__ import annotations

import ast
import hashlib
from functools import cache
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def _module_path(name: str) -> Path:
    rel = name.split(".")
    path = PACKAGE_DIR.joinpath(*rel).with_suffix(".py")
    if path.exists():
        return path
    pkg = PACKAGE_DIR.joinpath(*rel, "__init__.py")
    if pkg.exists():
        return pkg
    raise ValueError(f"no specgate module named {name!r} under {PACKAGE_DIR}")


def _local_imports(tree: ast.AST, name: str) -> set[str]:
    """specgate-internal modules imported by module `name` (dotted, relative to the package)."""
    package = ["specgate", *name.split(".")[:-1]]
    candidates = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            candidates += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            candidates += [module] + [f"{module}.{alias.name}" for alias in node.names]
    return {c.removeprefix("specgate.") for c in candidates if c.startswith("specgate.") and _exists(c.removeprefix("specgate."))}


def _exists(name: str) -> bool:
    try:
        _module_path(name)
        return True
    except ValueError:
        return False


@cache
def _parsed(name: str) -> tuple[str, frozenset[str]]:
    tree = ast.parse(_module_path(name).read_text())
    return ast.dump(tree, include_attributes=False), frozenset(_local_imports(tree, name))


def module_closure(*names: str) -> list[str]:
    """The named modules plus every specgate module they import, transitively, sorted."""
    seen: set[str] = set()
    todo = list(names)
    while todo:
        name = todo.pop()
        if name in seen or name == "__init__":
            continue
        seen.add(name)
        todo.extend(_parsed(name)[1])
    return sorted(seen)


def code_fingerprint(*names: str) -> str:
    """A short hash over the syntax trees of `names` and their specgate imports."""
    h = hashlib.sha256()
    for name in module_closure(*names):
        h.update(name.encode() + b"\0" + _parsed(name)[0].encode() + b"\0")
    return h.hexdigest()[:16]
