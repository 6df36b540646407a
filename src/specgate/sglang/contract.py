"""What an adapter needs of SGLang's internals, checked against SGLang's source without importing it.

An adapter lists, per file under `sglang/srt`, the classes and module-level names it uses and the
exact parameter names of every function it calls or hooks (`CONTRACT`), plus the dataclass fields it
builds or reads (`FIELDS`). The check parses the files (no import: it runs on CPU, before SGLang is
loaded, and on any release's source) and names the first difference. Exact parameters, because a
parameter a release adds to a hooked method (0.5.17's `grammar_barrier`) is a duty the hook would skip.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import importlib.util
from pathlib import Path


def sglang_source_dir() -> Path | None:
    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None or not spec.submodule_search_locations:  # None: a bare folder named sglang
        return None
    return Path(list(spec.submodule_search_locations)[0]) / "srt"


def installed_version(srt_dir: Path) -> str | None:
    """The version of the SGLang whose sources are at `srt_dir`, from its dist-info beside it."""
    for info in sorted(srt_dir.parent.parent.glob("sglang-*.dist-info")):
        return info.name[len("sglang-") : -len(".dist-info")]
    version_file = srt_dir.parent / "version.py"
    if version_file.exists():
        for node in ast.parse(version_file.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
                return ast.literal_eval(node.value)
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return None


def members(tree: ast.Module) -> dict:
    """class name (None for module level) -> {member: parameter names, or [] for attributes}."""
    out: dict = {None: {}}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[None][node.name] = _params(node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):  # names the module imports are its members too
            out[None].update((a.asname or a.name.split(".")[0], []) for a in node.names)
        elif isinstance(node, ast.Assign):
            out[None].update((t.id, []) for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.ClassDef):
            found = out.setdefault(node.name, {})
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found[item.name] = _params(item)
                    for attr in _self_attributes(item):  # instance attributes: self.x = ... in any method
                        found.setdefault(attr, [])
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    found[item.target.id] = []
                elif isinstance(item, ast.Assign):
                    found.update((t.id, []) for t in item.targets if isinstance(t, ast.Name))
    return out


@functools.lru_cache(maxsize=64)
def _members_of(source: str) -> dict:
    """members() of one file's text, parsed once (several adapters read the same files)."""
    return members(ast.parse(source))


def _self_attributes(fn) -> set[str]:
    names = set()
    for node in ast.walk(fn):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        for t in targets:
            for el in t.elts if isinstance(t, ast.Tuple) else [t]:
                if isinstance(el, ast.Attribute) and isinstance(el.value, ast.Name) and el.value.id == "self":
                    names.add(el.attr)
    return names


def _params(fn) -> list[str]:
    a = fn.args
    return [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]


def mismatches(srt_dir: Path, contract: dict, fields: dict, first: bool = True) -> list[str]:
    """The differences between the source at `srt_dir` and an adapter's tables (only the first by default)."""
    wanted: dict = {}
    for table in (contract, fields):
        for rel, classes in table.items():
            for cls, spec in classes.items():
                spec = spec if isinstance(spec, dict) else dict.fromkeys(spec)
                wanted.setdefault(rel, {}).setdefault(cls, {}).update(spec)
    out: list[str] = []
    for rel, classes in wanted.items():
        path = srt_dir / rel
        if not path.exists():
            out.append(f"{rel} is missing")
            continue
        found = _members_of(path.read_text())
        for cls, spec in classes.items():
            if cls not in found:
                out.append(f"{rel}: class {cls} is missing")
                continue
            for name, params in spec.items():
                where = f"{rel}: {cls + '.' if cls else ''}{name}"
                if name not in found[cls]:
                    out.append(f"{where} is missing")
                elif params and found[cls][name] != params:
                    out.append(f"{where} takes {found[cls][name]}, expected {params}")
        if first and out:
            return out[:1]
    return out
