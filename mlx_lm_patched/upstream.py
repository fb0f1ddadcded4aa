"""Upstream staging and release tracking: the patches as a quilt series.

``python -m mlx_lm_patched.upstream COMMAND``:

- ``patches``: write ``patches/NN-<name>.patch`` (DEP-3 header, unified diff
  against the pinned mlx-lm sdist, for ``patch -p1``) for each entry of
  ``PATCHES``, in order, and ``patches/series``. Each patch rewrites upstream's
  source: a replaced attribute's definition (decorators, property getter and
  setter included) gives way to the replacement's source, a new method goes
  next to its neighbours in the patch's namespace class, a new module-level
  object goes before the first definition that uses it (a module target is
  an ``import``, among the first block of imports; any other value is its
  assignment in the patch's file), a removed one goes.
- ``check-patches``: fail if regenerating would change ``patches/``, if the
  series does not apply in order to a fresh sdist tree, if a fingerprint does
  not match the pinned source, if the patched source uses a name it does not
  define, or if the patched modules do not import (naming the first patch
  after which they do not).
- ``vendor``: build ``dist/mlx_lm-<pinned>+patched.N`` (N patches in the
  series), a wheel of the sdist with the series applied.
- ``test [FILE ...]``: run upstream's cache-related tests offline, unpatched
  and patched, and compare; the hub model they load is a tiny random-weight
  stand-in in a Hugging Face cache of its own (``HF_HUB_OFFLINE=1``), so
  upstream's ``load`` runs unchanged. ``-p mlx_lm_patched.upstream`` records
  each test's outcome.
- ``check-release [VERSION]``: per patch and target, does that release (default
  the latest) still have the upstream source each patch was written for, and
  does the series apply to it.

The sdist is fetched with ``pip download`` into ``.upstream/`` (git-ignored).
The Description of a patch is its ``summary`` and the docstring of the module
defining ``PATCH``; ``Bug:`` lines come from mlx-lm issue references in that
docstring (``ml-explore/mlx-lm#N``, ``#N``, issue URLs) and a module-level
``BUGS`` list. ``Last-Update`` changes only when the patch body does.
"""

import argparse
import ast
import datetime
import difflib
import functools
import importlib.util
import inspect
import io
import json
import os
import re
import shutil
import subprocess
import symtable
import sys
import tarfile
import tempfile
import textwrap
import tokenize
import types
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import _registry
from ._registry import UPSTREAM_VERSION, Patch, Target

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("MLX_LM_PATCHED_UPSTREAM_CACHE", ROOT / ".upstream"))
PATCH_DIR = ROOT / "patches"
DIST_DIR = ROOT / "dist"
ISSUES = "https://github.com/ml-explore/mlx-lm/issues/"
PATCH_FILE = re.compile(r"^\d\d-.+\.patch$")

# Upstream test files that exercise the caches and run offline once the hub
# model they load is replaced by a tiny local one.
TEST_FILES = (
    "test_prompt_cache.py",
    "test_models.py",
    "test_generate.py",
    "test_server.py",
    "test_muse_spark.py",
)
# The hub model those files load, and the tiny stand-in built for it.
HUB_MODELS = {
    "mlx-community/Qwen1.5-0.5B-Chat-4bit": {
        "family": "llama",
        # Qwen1.5-0.5B's attention shape (16 heads of 64, no GQA), fewer heads.
        "config": {
            "model_type": "qwen2",
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "intermediate_size": 512,
        },
        "quantize": {"group_size": 64, "bits": 4},
        "dtype": "float16",
    },
}
# Upstream tests a patch changes on purpose (they pin the behaviour it fixes
# or an internal detail it replaces): node id -> why. Keep this short.
ACCEPTED_CHANGES: Dict[str, str] = {
    "test_prompt_cache.py::TestPromptCache::test_batch_rotating_kv_cache": (
        "batch_rotating_prealloc: the ring holds max_size slots from the first "
        "update, so after filter keys are (1, 1, 4, 8), not upstream's (1, 1, 3, 8)"
    ),
    "test_server.py::TestServerKVCacheQuantization::test_quantized_kv_disables_batching": (
        "batch_quantized: the server keeps batching on with --kv-bits on purpose"
    ),
}
MODELS_ENV = "MLX_LM_PATCHED_UPSTREAM_MODELS"
REPORT_ENV = "MLX_LM_PATCHED_UPSTREAM_REPORT"


class UpstreamUnavailable(RuntimeError):
    """The mlx-lm sdist could not be downloaded."""


class GenerateError(RuntimeError):
    """A patch cannot be written as a diff of upstream's source."""


# -- the pinned (or any) upstream sdist ---------------------------------------


def sdist_tree(version: str = UPSTREAM_VERSION) -> Path:
    """The extracted sdist of mlx-lm ``version``, downloaded once into CACHE.

    Treat it as read-only: copy it (``fresh_tree``) before patching.
    """
    tree = CACHE / f"mlx_lm-{version}"
    if (tree / "PKG-INFO").exists():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    archive = CACHE / f"mlx_lm-{version}.tar.gz"
    if not archive.exists():
        with tempfile.TemporaryDirectory(dir=CACHE) as d:
            spec = "mlx-lm" if version == "latest" else f"mlx-lm=={version}"
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps"]
            cmd += ["--no-binary", ":all:", "--disable-pip-version-check", "-q"]
            cmd += [spec, "-d", d]
            r = subprocess.run(cmd, capture_output=True, text=True)
            found = sorted(Path(d).glob("*.tar.gz"))
            if r.returncode or not found:
                raise UpstreamUnavailable(
                    f"could not download the mlx-lm {version} sdist "
                    f"({' '.join(cmd[1:])}): {(r.stderr or r.stdout).strip()[-800:]}"
                )
            if version == "latest":
                version = found[0].name[len("mlx_lm-") : -len(".tar.gz")]
                tree = CACHE / f"mlx_lm-{version}"
                archive = CACHE / found[0].name
                if (tree / "PKG-INFO").exists():
                    return tree
            os.replace(found[0], archive)
    with tempfile.TemporaryDirectory(dir=CACHE) as d:
        with tarfile.open(archive) as tf:
            if hasattr(tarfile, "data_filter"):
                tf.extractall(d, filter="data")
            else:  # pragma: no cover - Python < 3.11.4
                tf.extractall(d)
        (top,) = [p for p in Path(d).iterdir() if p.is_dir()]
        try:
            os.replace(top, tree)
        except OSError:
            if not (tree / "PKG-INFO").exists():
                raise
    return tree


def fresh_tree(dest: Path, version: str = UPSTREAM_VERSION) -> Path:
    """A writable copy of the sdist tree at ``dest`` (which must not exist)."""
    shutil.copytree(sdist_tree(version), dest)
    return dest


# -- reading definitions out of source text -----------------------------------


def _lines(text: str) -> List[str]:
    return text.splitlines(keepends=True)


@functools.lru_cache(maxsize=16)
def _parse(text: str) -> ast.Module:
    """``ast.parse``, cached: the trees are only read."""
    return ast.parse(text)


def _start(node: ast.stmt) -> int:
    """0-based first line of a statement, decorators included."""
    lines = [node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]
    return min(lines) - 1


def _span(lines: List[str], node: ast.stmt) -> Tuple[int, int]:
    """0-based [start, end) lines of a definition, as ``inspect.getsource``
    cuts it (``inspect.getblock`` from its first decorator)."""
    start = _start(node)
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return start, start + len(inspect.getblock(lines[start:]))
    return start, node.end_lineno


def _decorator_kind(node: ast.stmt, attr: str) -> str:
    for d in getattr(node, "decorator_list", []):
        if isinstance(d, ast.Name) and d.id == "property":
            return "getter"
        if (
            isinstance(d, ast.Attribute)
            and isinstance(d.value, ast.Name)
            and d.value.id == attr
            and d.attr in ("setter", "deleter")
        ):
            return d.attr
    return "plain"


def _assigns(node: ast.stmt, attr: str) -> bool:
    if isinstance(node, ast.Assign):
        return any(isinstance(t, ast.Name) and t.id == attr for t in node.targets)
    if isinstance(node, ast.AnnAssign):
        return isinstance(node.target, ast.Name) and node.target.id == attr
    return False


def _class_node(tree: ast.Module, qualname: str) -> Optional[ast.ClassDef]:
    body, node = tree.body, None
    for part in qualname.split("."):
        node = next(
            (n for n in body if isinstance(n, ast.ClassDef) and n.name == part), None
        )
        if node is None:
            return None
        body = node.body
    return node


@functools.lru_cache(maxsize=256)
def find_class(text: str, qualname: str) -> Optional[ast.ClassDef]:
    """The class ``qualname`` defined at the top of ``text``. Parses only that
    class when its ``class`` line can be found (line numbers are the file's),
    as rewriting a patch re-reads the file after every change."""
    top, _, _ = qualname.partition(".")
    lines = _lines(text)
    pattern = re.compile(rf"class\s+{re.escape(top)}\b")
    start = next((i for i, line in enumerate(lines) if pattern.match(line)), None)
    if start is None:
        return None
    while start > 0 and lines[start - 1].startswith("@"):
        start -= 1
    try:
        module = ast.parse("".join(inspect.getblock(lines[start:])))
    except SyntaxError:
        module = None
    if (
        module is None
        or not module.body
        or not isinstance(module.body[0], ast.ClassDef)
    ):
        return _class_node(_parse(text), qualname)
    ast.increment_lineno(module, start)
    return _class_node(module, qualname)


@dataclass
class Definition:
    kind: str  # "plain" | "getter" | "setter" | "deleter" | "value"
    start: int
    end: int


def find_definitions(text: str, cls: Optional[str], attr: str) -> List[Definition]:
    """Where ``attr`` is defined in class ``cls`` (or the module body)."""
    if cls is None:
        body = _parse(text).body
    else:
        node = find_class(text, cls)
        if node is None:
            raise GenerateError(f"class {cls} not found")
        body = node.body
    lines, found = _lines(text), []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == attr:
                found.append(
                    Definition(_decorator_kind(node, attr), *_span(lines, node))
                )
        elif _assigns(node, attr):
            found.append(Definition("value", *_span(lines, node)))
    return found


def _bases(text: str, cls: str) -> List[str]:
    node = find_class(text, cls)
    names = [b.id for b in node.bases if isinstance(b, ast.Name)] if node else []
    return [n for n in names if find_class(text, n) is not None]


def source_from_text(
    text: str, cls: Optional[str], attr: str
) -> Tuple[Optional[str], str]:
    """``(source, where)``: what ``_registry.source_of`` gives for ``attr`` of
    ``cls`` in a module whose source is ``text`` (``None``: not defined or
    not a function/class/property); ``where`` names the defining class."""
    lines = _lines(text)
    todo, seen = [cls], set()
    while todo:
        c = todo.pop(0)
        if c in seen:
            continue
        seen.add(c)
        defs = find_definitions(text, c, attr)
        if defs:
            where = c or "module"
            if defs[-1].kind == "value":
                return None, where
            parts = [d for d in defs if d.kind in ("getter", "setter")]
            if any(d.kind == "getter" for d in parts):
                parts.sort(key=lambda d: d.kind != "getter")
            else:
                parts = [defs[-1]]
            src = "".join(
                textwrap.dedent("".join(lines[d.start : d.end])) for d in parts
            )
            return src, where
        if c is not None:
            todo += _bases(text, c)
    return None, "absent"


def fingerprint_text(source: str) -> str:
    import hashlib

    return hashlib.sha256(source.encode()).hexdigest()[:12]


# -- replacement source from the live objects ---------------------------------


def _functions(new) -> List:
    if isinstance(new, property):
        return [f for f in (new.fget, new.fset, new.fdel) if f is not None]
    if isinstance(new, (staticmethod, classmethod)):
        return [new.__func__]
    if inspect.isfunction(new) or inspect.isclass(new):
        return [new]
    return []


def _assignment_lines(attr: str, cls: Optional[str], origin) -> Optional[List[str]]:
    """The statement assigning ``attr`` at the top of the file ``origin`` (in
    its class named like ``cls``, for a class attribute), if there is one."""
    if not origin or not Path(origin).exists():
        return None
    text = Path(origin).read_text()
    body = _parse(text).body
    if cls is not None:
        node = find_class(text, cls.split(".")[-1])
        body = node.body if node is not None else []
    lines = _lines(text)
    for stmt in body:
        if _assigns(stmt, attr):
            start, end = _span(lines, stmt)
            return lines[start:end]
    return None


def replacement_lines(
    new, attr: str, indent: str, origin=None, cls: Optional[str] = None
) -> List[str]:
    """The source of ``new`` re-indented to ``indent``, as written in its
    module (a property's getter, setter and the blank lines between). A
    module is an ``import``; any other value is its assignment in ``origin``
    (the patch's file), else its ``repr`` if that reads back equal."""
    if isinstance(new, types.ModuleType):
        line = f"import {new.__name__}"
        return [indent + line + ("\n" if attr == new.__name__ else f" as {attr}\n")]
    funcs = _functions(new)
    if not funcs:
        found = _assignment_lines(attr, cls, origin)
        if found:
            old = re.match(r"[ \t]*", found[0]).group(0)
            return _reindent(found, old, indent)
        text = f"{attr} = {new!r}\n"
        try:
            same = ast.literal_eval(repr(new)) == new
        except (ValueError, SyntaxError):
            same = False
        if not same:
            raise GenerateError(f"{attr}: cannot write {type(new).__name__} as source")
        return [indent + text]
    blocks = [_source_block(f) for f in funcs]
    blocks.sort(key=lambda b: b[0])
    out: List[str] = []
    for i, (s, e, file_lines) in enumerate(blocks):
        if i:
            gap = file_lines[blocks[i - 1][1] : s]
            out += gap if gap and all(not g.strip() for g in gap) else ["\n"]
        out += file_lines[s:e]
    old = re.match(r"[ \t]*", out[0]).group(0)
    return _reindent(out, old, indent)


def _source_file(obj) -> Optional[str]:
    """The file ``obj`` was written in. A class's own functions say it even
    when its ``__module__`` names another module (a class meant to look
    native to ``mlx_lm.models.cache``), where ``inspect`` would look."""
    if inspect.isclass(obj):
        for value in vars(obj).values():
            for f in _functions(value):
                if inspect.isfunction(f):
                    return f.__code__.co_filename
    try:
        return inspect.getsourcefile(obj)
    except TypeError:
        return None


def _source_block(obj) -> Tuple[int, int, List[str]]:
    """``(start, end, lines)``: ``obj``'s lines ``[start, end)`` of its file."""
    if inspect.isclass(obj):
        file = _source_file(obj)
        text = Path(file).read_text() if file else ""
        node = find_class(text, obj.__qualname__) if text else None
        if node is None:
            raise GenerateError(f"no source for class {obj.__qualname__}")
        lines = _lines(text)
        return (*_span(lines, node), lines)
    block, lnum = inspect.getsourcelines(obj)
    return lnum - 1, lnum - 1 + len(block), inspect.findsource(obj)[0]


def _string_rows(lines: List[str]) -> set:
    """1-based rows that start inside a multi-line string (left untouched)."""
    rows = set()
    toks = tokenize.generate_tokens(io.StringIO("".join(lines)).readline)
    for tok in toks:
        if tok.start[0] < tok.end[0] and tok.type not in (
            tokenize.NL,
            tokenize.NEWLINE,
        ):
            rows.update(range(tok.start[0] + 1, tok.end[0] + 1))
    return rows


def _reindent(lines: List[str], old: str, new: str) -> List[str]:
    if old == new:
        return list(lines)
    inside = _string_rows(lines)
    out = []
    for row, line in enumerate(lines, 1):
        if row in inside or not line.strip():
            out.append(line if row in inside else "\n")
        elif line.startswith(old):
            out.append(new + line[len(old) :])
        else:
            out.append(line)
    return out


# -- rewriting upstream's source, one patch at a time -------------------------


def module_file(module: str, tree: Path) -> str:
    """Path of ``module`` relative to the sdist root."""
    rel = module.replace(".", "/")
    if (tree / rel / "__init__.py").exists():
        return f"{rel}/__init__.py"
    return f"{rel}.py"


def _split_owner(owner: str) -> Tuple[str, Optional[str]]:
    module, _, cls = owner.partition(":")
    return module, (cls or None)


def _body_indent(text: str, cls: str) -> str:
    node = find_class(text, cls)
    return " " * node.body[0].col_offset


def _attached_comments(lines: List[str], start: int) -> int:
    """Move ``start`` up over comment lines directly above it."""
    indent = re.match(r"[ \t]*", lines[start]).group(0)
    while start > 0 and lines[start - 1].startswith(indent + "#"):
        start -= 1
    return start


def _is_removal(t: Target) -> bool:
    return t.new is getattr(_registry, "REMOVED", None)


def _rewrite_target(text: str, t: Target, siblings: List[Target], origin=None) -> str:
    """``text`` with target ``t`` replaced, inserted or removed."""
    _, cls = _split_owner(t.owner)
    lines = _lines(text)
    defs = find_definitions(text, cls, t.attr)
    where = f"{t.owner}.{t.attr}"
    if _is_removal(t):
        if not defs:
            raise GenerateError(f"{where}: to be removed, but not defined upstream")
        gap = 1 if cls else 2  # blank lines between definitions
        for d in sorted(defs, key=lambda d: -d.start):
            start, end = _attached_comments(lines, d.start), d.end
            for _ in range(gap):
                if end < len(lines) and not lines[end].strip():
                    end += 1
                elif start > 0 and not lines[start - 1].strip():
                    start -= 1
            del lines[start:end]
        return "".join(lines)
    indent = _body_indent(text, cls) if cls else ""
    new = replacement_lines(t.new, t.attr, indent, origin, cls)
    if defs:
        first = min(d.start for d in defs)
        for d in sorted(defs, key=lambda d: -d.start):
            end = d.end
            if d.start != first and end < len(lines) and not lines[end].strip():
                end += 1
            lines[d.start : end] = new if d.start == first else []
        return "".join(lines)
    if cls is None:
        return text  # new module-level objects are placed by _place_module_level
    # A new attribute goes where the namespace class has it: after the nearest
    # earlier sibling that the class defines, else before the nearest later one.
    i = next(k for k, s in enumerate(siblings) if s is t)
    for s in reversed(siblings[:i]):
        found = find_definitions(text, cls, s.attr)
        if found:
            at = max(d.end for d in found)
            lines[at:at] = ["\n"] + new
            return "".join(lines)
    for s in siblings[i + 1 :]:
        found = find_definitions(text, cls, s.attr)
        if found:
            at = _attached_comments(lines, min(d.start for d in found))
            lines[at:at] = new + ["\n"]
            return "".join(lines)
    node = find_class(text, cls)
    at = _span(lines, node.body[-1])[1]
    lines[at:at] = ["\n"] + new
    return "".join(lines)


_IMPORTS = (ast.Import, ast.ImportFrom)


def _first_definition(body: List[ast.stmt]) -> int:
    return next(
        (i for i, n in enumerate(body) if not isinstance(n, _IMPORTS + (ast.Expr,))),
        len(body),
    )


def _import_line(text: str, name: str) -> int:
    """Where ``import name`` goes, isort-style: among the plain imports of the
    first block of imports (stdlib, in upstream's files), in name order."""
    body = _parse(text).body
    group: List[ast.stmt] = []
    for node in body[: _first_definition(body)]:
        if not isinstance(node, _IMPORTS):
            continue
        if group and node.lineno > group[-1].end_lineno + 1:
            break  # a blank line ends the first block
        group.append(node)
    if not group:
        return 0
    for node in group:
        if isinstance(node, ast.ImportFrom) or node.names[0].name > name:
            return node.lineno - 1
    return group[-1].end_lineno


def _imports(text: str, name: str) -> bool:
    """Whether the module binds ``name`` with an import statement."""
    for node in _parse(text).body:
        if isinstance(node, _IMPORTS):
            for alias in node.names:
                if (alias.asname or alias.name.split(".")[0]) == name:
                    return True
    return False


def _uses(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def _place_module_level(text: str, t: Target, origin=None) -> str:
    """Insert a new module-level object before the first statement using it
    (an import after the imports at the top)."""
    if find_definitions(text, None, t.attr) or _imports(text, t.attr):
        return text
    lines = _lines(text)
    new = replacement_lines(t.new, t.attr, "", origin)
    if isinstance(t.new, types.ModuleType):
        at = _import_line(text, t.new.__name__)
        lines[at:at] = new
        return "".join(lines)
    for node in _parse(text).body:
        if not isinstance(node, (ast.Import, ast.ImportFrom)) and _uses(node, t.attr):
            at = _attached_comments(lines, _start(node))
            lines[at:at] = new + ["\n", "\n"]
            return "".join(lines)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return "".join(lines + ["\n", "\n"] + new)


def apply_to_sources(files: Dict[str, str], patch: Patch, tree: Path) -> Dict[str, str]:
    """The files a patch touches, rewritten; ``files`` holds earlier patches'
    output (anything missing is read from ``tree``)."""
    out = dict(files)
    origin = getattr(_patch_module(patch), "__file__", None)
    for t in patch.targets:
        module, _ = _split_owner(t.owner)
        rel = module_file(module, tree)
        if rel not in out:
            path = tree / rel
            if not path.exists():
                raise GenerateError(f"{patch.name}: {rel} is not in the sdist")
            out[rel] = path.read_text()
        siblings = [
            s for s in patch.targets if s.owner == t.owner and not _is_removal(s)
        ]
        try:
            out[rel] = _rewrite_target(out[rel], t, siblings, origin)
        except GenerateError as e:
            raise GenerateError(f"patch {patch.name!r}: {e}") from None
    # Last first, so an object an earlier one is used by is already in place.
    for t in reversed(patch.targets):
        module, cls = _split_owner(t.owner)
        if cls is None and not _is_removal(t):
            rel = module_file(module, tree)
            out[rel] = _place_module_level(out[rel], t, origin)
    for rel, text in out.items():
        try:
            compile(text, rel, "exec")
        except SyntaxError as e:
            raise GenerateError(f"patch {patch.name!r}: {rel} no longer parses: {e}")
    return out


def undefined_names(text: str, filename: str) -> set:
    """Global names the module's code reads but never binds."""
    top = symtable.symtable(text, filename, "exec")
    bound = {
        s.get_name()
        for s in top.get_symbols()
        if s.is_assigned() or s.is_imported() or s.is_namespace()
    }
    used = {s.get_name() for s in top.get_symbols() if s.is_referenced()}

    def walk(table):
        for s in table.get_symbols():
            if s.is_referenced() and (s.is_global() or s.is_declared_global()):
                used.add(s.get_name())
        for child in table.get_children():
            walk(child)

    for child in top.get_children():
        walk(child)
    import builtins

    return used - bound - set(dir(builtins)) - {"__file__", "__name__", "__spec__"}


# -- patch files ---------------------------------------------------------------


def _patch_module(patch: Patch):
    for mod in list(sys.modules.values()):
        if getattr(mod, "PATCH", None) is patch:
            return mod
    # A function's module may be its owner's (``_registry.pasted_into``); its
    # code still says which file it was written in.
    files = {_source_file(f) for t in patch.targets for f in _functions(t.new)}
    for mod in list(sys.modules.values()):
        if getattr(mod, "__file__", None) in files:
            return mod
    return None


def _bug_links(patch: Patch, doc: str, module) -> List[str]:
    found = list(getattr(patch, "bugs", ()) or ()) + list(getattr(module, "BUGS", ()))
    pattern = re.compile(
        r"https://github\.com/ml-explore/mlx-lm/(?:issues|pull)/(\d+)"
        r"|ml-explore/mlx-lm#(\d+)|(?<![\w/])#(\d+)\b"
    )
    for m in pattern.finditer(f"{patch.summary}\n{doc}"):
        found.append(ISSUES + next(g for g in m.groups() if g))
    return list(dict.fromkeys(found))


def _description(patch: Patch) -> Tuple[List[str], str, List[str]]:
    """(Description lines, Origin, Bug links) for a patch's header."""
    module = _patch_module(patch)
    doc = getattr(patch, "description", None) or inspect.getdoc(module) or ""
    body = doc.splitlines()
    if body and body[0].strip().rstrip(".") == patch.summary.strip().rstrip("."):
        body = body[1:]
    while body and not body[0].strip():
        body = body[1:]
    lines = [f"Description: {patch.summary}"]
    lines += [f" {line}" if line.strip() else " ." for line in body]
    origin = "vendor, mlx-lm-patched"
    if module is not None and getattr(module, "__file__", None):
        path = Path(module.__file__).resolve()
        origin += (
            f" {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}"
        )
    return lines, origin, _bug_links(patch, doc, module)


def _today() -> str:
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    now = (
        datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc)
        if epoch
        else datetime.datetime.now(datetime.timezone.utc)
    )
    return now.date().isoformat()


def _without_date(text: str) -> str:
    return re.sub(r"(?m)^Last-Update: .*\n", "", text, count=1)


def patch_file_text(patch: Patch, diff: str, old: Optional[str]) -> str:
    """Header + diff; ``Last-Update`` kept from ``old`` if nothing else changed."""
    desc, origin, bugs = _description(patch)
    head = desc + [f"Origin: {origin}"]
    head += [f"Bug: {b}" for b in bugs]
    head += ["Forwarded: no", "Upstream-Status: pending"]
    date = "@DATE@"
    text = "\n".join(head + [f"Last-Update: {date}", "---", ""]) + diff
    if old is not None and _without_date(old) == _without_date(text):
        date = re.search(r"(?m)^Last-Update: (.*)$", old).group(1)
    else:
        date = _today()
    return text.replace("Last-Update: @DATE@", f"Last-Update: {date}", 1)


def patch_name(i: int, patch: Patch) -> str:
    return f"{i + 1:02d}-{patch.name}.patch"


@dataclass
class Series:
    files: Dict[str, str]  # file name in patches/ -> content, "series" included
    final: Dict[str, str]  # sdist-relative path -> source with every patch
    warnings: List[str] = field(default_factory=list)
    steps: List[Tuple[str, Dict[str, str]]] = field(default_factory=list)


def generate(
    patches: Sequence[Patch], tree: Path, patch_dir: Optional[Path] = None
) -> Series:
    """Every patch file (and ``series``) as they should be in ``patch_dir``."""
    patch_dir = PATCH_DIR if patch_dir is None else patch_dir
    files: Dict[str, str] = {}
    current: Dict[str, str] = {}
    names, warnings, steps = [], [], []
    for i, patch in enumerate(patches):
        after = apply_to_sources(current, patch, tree)
        diff = []
        for rel in sorted(after):
            before = current.get(rel)
            if before is None:
                before = (tree / rel).read_text()
            if before == after[rel]:
                continue
            if not after[rel].endswith("\n") or not before.endswith("\n"):
                raise GenerateError(f"{rel}: no newline at end of file")
            diff += difflib.unified_diff(
                _lines(before), _lines(after[rel]), f"a/{rel}", f"b/{rel}", n=3
            )
            missing = undefined_names(after[rel], rel) - undefined_names(before, rel)
            if missing:
                warnings.append(
                    f"patch {patch.name!r}: {rel} uses {sorted(missing)} but does not "
                    "define them (add a module-level target for each)"
                )
        if not diff:
            warnings.append(f"patch {patch.name!r} changes nothing")
        name = patch_name(i, patch)
        old_path = patch_dir / name
        old = old_path.read_text() if old_path.exists() else None
        files[name] = patch_file_text(patch, "".join(diff), old)
        names.append(name)
        steps.append((name, after))
        current = after
    files["series"] = "".join(f"{n}\n" for n in names)
    return Series(files, current, warnings, steps)


def _all_patches() -> List[Patch]:
    import mlx_lm_patched

    return list(mlx_lm_patched.PATCHES)


def write_patches(series: Series, patch_dir: Path = PATCH_DIR) -> List[str]:
    """Write the series; remove stale ``NN-*.patch`` files. Returns changes."""
    patch_dir.mkdir(parents=True, exist_ok=True)
    changed = []
    for name, text in series.files.items():
        path = patch_dir / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(name)
    for path in sorted(patch_dir.iterdir()):
        if PATCH_FILE.match(path.name) and path.name not in series.files:
            path.unlink()
            changed.append(f"{path.name} (removed)")
    return changed


def compare_patches(series: Series, patch_dir: Path = PATCH_DIR) -> List[str]:
    """How ``patch_dir`` differs from the regenerated series."""
    problems = []
    for name, text in series.files.items():
        path = patch_dir / name
        if not path.exists():
            problems.append(f"{name}: missing")
            continue
        old = path.read_text()
        if old != text:
            delta = list(
                difflib.unified_diff(
                    _lines(old),
                    _lines(text),
                    f"{name} (in patches/)",
                    f"{name} (regenerated)",
                    n=1,
                )
            )
            shown = "".join(delta[:30]) + ("  ...\n" if len(delta) > 30 else "")
            problems.append(f"{name}: differs from the regenerated patch\n{shown}")
    if patch_dir.exists():
        for path in sorted(patch_dir.iterdir()):
            if PATCH_FILE.match(path.name) and path.name not in series.files:
                problems.append(f"{path.name}: not in PATCHES (stale)")
    return problems


def read_series(patch_dir: Path = PATCH_DIR) -> List[str]:
    path = patch_dir / "series"
    if not path.exists():
        return []
    return [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def touched_files(patch_dir: Path = PATCH_DIR) -> List[str]:
    """The sdist-relative files the series changes."""
    found = []
    for name in read_series(patch_dir):
        text = (patch_dir / name).read_text()
        found += re.findall(r"(?m)^\+\+\+ b/(\S+)", text)
    return list(dict.fromkeys(found))


@dataclass
class Applied:
    name: str
    ok: bool
    output: str

    @property
    def inexact(self) -> bool:
        return "offset" in self.output or "fuzz" in self.output


def apply_series(
    tree: Path, patch_dir: Path = PATCH_DIR, exact: bool = True
) -> List[Applied]:
    """Apply the series to ``tree`` with ``patch -p1``, stopping at a failure."""
    if shutil.which("patch") is None:
        raise RuntimeError("the `patch` program is not installed")
    done = []
    for name in read_series(patch_dir):
        cmd = ["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch"]
        cmd += ["--fuzz=0"] if exact else []
        cmd += ["-d", str(tree), "-i", str((patch_dir / name).resolve())]
        r = subprocess.run(cmd, capture_output=True, text=True)
        done.append(Applied(name, r.returncode == 0, (r.stdout + r.stderr).strip()))
        if r.returncode:
            break
    return done


# -- commands -------------------------------------------------------------------


def cmd_patches(args) -> int:
    series = generate(_all_patches(), sdist_tree())
    changed = write_patches(series)
    for w in series.warnings:
        print(f"warning: {w}", file=sys.stderr)
    n = len(series.files) - 1
    what = ", ".join(changed) if changed else "unchanged"
    print(f"patches/: {n} patch(es) against mlx-lm {UPSTREAM_VERSION}: {what}")
    return 0


def check_patches(patch_dir: Path = PATCH_DIR, patches=None) -> List[str]:
    """Everything wrong with ``patch_dir``; empty when it is up to date."""
    tree = sdist_tree()
    patches = _all_patches() if patches is None else patches
    series = generate(patches, tree, patch_dir)
    problems = compare_patches(series, patch_dir)
    problems += [
        f"{c.patch}: {c.where} {c.status} upstream ({c.detail or 'no fingerprint'}), "
        "so the monkeypatch would not apply"
        for c in check_targets(patches, tree, series)
        if not c.ok
    ]
    problems += [f"undefined names: {w}" for w in series.warnings if "uses" in w]
    with tempfile.TemporaryDirectory(prefix="mlx-lm-check-") as d:
        work = fresh_tree(Path(d) / "tree")
        results = apply_series(work, patch_dir)
        for a in results:
            if not a.ok:
                problems.append(
                    f"{a.name} does not apply with `patch -p1 --fuzz=0` after the "
                    f"patches before it:\n{textwrap.indent(a.output, '    ')}"
                )
        if all(a.ok for a in results) and not problems:
            for rel, text in series.final.items():
                if (work / rel).read_text() != text:
                    problems.append(f"the series applied gives a different {rel}")
            if import_errors(work, series.final):
                problems += _first_import_error(series, tree, Path(d) / "steps")
    return problems


def _first_import_error(series: Series, tree: Path, work: Path) -> List[str]:
    """Name the first patch after which the patched modules do not import."""
    fresh_tree(work)
    for name, files in series.steps:
        for rel, text in files.items():
            (work / rel).write_text(text)
        errors = import_errors(work, list(files))
        if errors:
            return [f"after {name}, {e}" for e in errors]
    return ["the patched modules do not import"]


def import_errors(tree: Path, files: Sequence[str]) -> List[str]:
    """Import the patched modules from ``tree`` in a fresh interpreter."""
    modules = [
        rel[: -len(".py")].replace("/", ".").removesuffix(".__init__") for rel in files
    ]
    if not modules:
        return []
    code = (
        "import importlib, sys\n"
        "for m in sys.argv[1:]:\n"
        "    f = importlib.import_module(m).__file__\n"
        "    assert f.startswith(sys.path[0]), f'{m} imported from {f}'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tree), "MLX_LM_PATCHED_APPLY": "0"}
    r = subprocess.run(
        [sys.executable, "-c", code, *modules],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if r.returncode == 0:
        return []
    last = (r.stderr or r.stdout).strip().splitlines()[-6:]
    return [
        f"the patched {', '.join(modules)} do not import:\n"
        + textwrap.indent("\n".join(last), "    ")
    ]


def cmd_check_patches(args) -> int:
    problems = check_patches()
    if problems:
        print("check-patches: FAILED", file=sys.stderr)
        for p in problems:
            print(f"- {p}", file=sys.stderr)
        if any(re.match(r"\S+: (missing|differs|not in PATCHES)", p) for p in problems):
            print("Run `make patches` and commit patches/.", file=sys.stderr)
        return 1
    n = len(read_series())
    print(
        f"check-patches: OK ({n} patch(es) up to date, apply to mlx-lm {UPSTREAM_VERSION})"
    )
    return 0


def vendor_version(patch_dir: Path = PATCH_DIR) -> str:
    return f"{UPSTREAM_VERSION}+patched.{len(read_series(patch_dir))}"


def build_wheel(out_dir: Path = DIST_DIR, patch_dir: Path = PATCH_DIR) -> Path:
    """Build ``mlx_lm-<pinned>+patched.N`` from the sdist with the series applied."""
    version = vendor_version(patch_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlx-lm-vendor-") as d:
        work = fresh_tree(Path(d) / f"mlx_lm-{version}")
        for a in apply_series(work, patch_dir):
            if not a.ok:
                raise RuntimeError(f"{a.name} does not apply:\n{a.output}")
        errors = import_errors(work, touched_files(patch_dir))
        if errors:
            raise RuntimeError("\n".join(errors))
        env = dict(os.environ)
        env["SETUPTOOLS_SCM_PRETEND_VERSION_FOR_MLX_LM"] = version
        env["SETUPTOOLS_SCM_PRETEND_VERSION"] = version
        env.setdefault("SOURCE_DATE_EPOCH", "315532800")  # reproducible zip entries
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q"]
        cmd += ["--disable-pip-version-check", "-w", str(out_dir), str(work)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode:
            raise RuntimeError(f"wheel build failed:\n{(r.stdout + r.stderr)[-3000:]}")
    wheel = out_dir / f"mlx_lm-{version}-py3-none-any.whl"
    if not wheel.exists():
        raise RuntimeError(f"pip built no {wheel.name} in {out_dir}")
    return wheel


def cmd_vendor(args) -> int:
    stale = compare_patches(generate(_all_patches(), sdist_tree()))
    if stale:
        print(
            "warning: patches/ is not up to date (run `make patches`)", file=sys.stderr
        )
    try:
        wheel = build_wheel(Path(args.out))
    except RuntimeError as e:
        print(f"vendor: FAILED: {e}", file=sys.stderr)
        return 1
    print(f"vendor: {wheel.relative_to(ROOT) if wheel.is_relative_to(ROOT) else wheel}")
    return 0


# -- check-release ----------------------------------------------------------------


@dataclass
class TargetCheck:
    patch: str
    where: str
    status: str  # "match" | "new" | "changed" | "missing" | "exists" | "error"
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("match", "new")


def check_targets(
    patches: Sequence[Patch], tree: Path, series: Optional[Series] = None
) -> List[TargetCheck]:
    """Each target's recorded fingerprint against ``tree``'s source text (for
    a class an earlier patch adds, against that patch's source of it, from
    ``series`` if it was generated already)."""
    out, texts = [], {}
    current: Optional[Dict[str, str]] = {}  # None once a patch cannot be written
    for i, patch in enumerate(patches):
        for t in patch.targets:
            module, cls = _split_owner(t.owner)
            where = f"{module}.{cls + '.' if cls else ''}{t.attr}"
            if _is_removal(t):
                where += " (removed)"
            rel = module_file(module, tree)
            if rel not in texts:
                path = tree / rel
                texts[rel] = path.read_text() if path.exists() else None
            text = texts[rel]
            if text is None:
                out.append(TargetCheck(patch.name, where, "missing", f"no {rel}"))
                continue
            if cls and find_class(text, cls) is None and current:
                patched = current.get(rel)
                if patched and find_class(patched, cls) is not None:
                    text = patched
                    where += " (class added by an earlier patch)"
            try:
                src, found_in = source_from_text(text, cls, t.attr)
            except GenerateError as e:
                out.append(TargetCheck(patch.name, where, "missing", str(e)))
                continue
            if t.fingerprint is None:
                if found_in == "absent":
                    out.append(TargetCheck(patch.name, where, "new"))
                else:
                    out.append(
                        TargetCheck(
                            patch.name, where, "exists", f"now defined in {found_in}"
                        )
                    )
            elif found_in == "absent":
                out.append(TargetCheck(patch.name, where, "missing"))
            elif src is None:
                out.append(
                    TargetCheck(patch.name, where, "changed", "no longer a function")
                )
            else:
                fp = fingerprint_text(src)
                inherited = (
                    f" (inherited from {found_in})"
                    if found_in not in (cls, "module")
                    else ""
                )
                if fp == t.fingerprint:
                    out.append(
                        TargetCheck(patch.name, where, "match", f"{fp}{inherited}")
                    )
                else:
                    out.append(
                        TargetCheck(
                            patch.name,
                            where,
                            "changed",
                            f"fingerprint {fp}, written for {t.fingerprint}{inherited}",
                        )
                    )
        if series is not None:
            current = series.steps[i][1]
        elif current is not None:
            try:
                current = apply_to_sources(current, patch, tree)
            except GenerateError:
                current = None
    return out


def cmd_check_release(args) -> int:
    tree = sdist_tree(args.version)
    version = tree.name[len("mlx_lm-") :]
    checks = check_targets(_all_patches(), tree)
    print(f"mlx-lm {version} (patches written for {UPSTREAM_VERSION})")
    for name in dict.fromkeys(c.patch for c in checks):
        mine = [c for c in checks if c.patch == name]
        verdict = "matches" if all(c.ok for c in mine) else "DRIFTED"
        print(f"  {name}: {verdict}")
        for c in mine:
            print(
                f"    {c.status:8} {c.where}" + (f"  [{c.detail}]" if c.detail else "")
            )
    with tempfile.TemporaryDirectory(prefix="mlx-lm-release-") as d:
        work = fresh_tree(Path(d) / "tree", version)
        applied = apply_series(work, exact=False)
    names = read_series()
    print("  series:")
    for a in applied:
        how = (
            "applies"
            if a.ok and not a.inexact
            else "applies with offset/fuzz" if a.ok else "FAILS"
        )
        print(f"    {how:24} {a.name}")
        if not a.ok or a.inexact:
            print(textwrap.indent(a.output, "      "))
    for name in names[len(applied) :]:
        print(f"    {'not tried':24} {name}")
    ok = (
        all(c.ok for c in checks)
        and all(a.ok for a in applied)
        and len(applied) == len(names)
    )
    print(f"check-release {version}: {'OK' if ok else 'DRIFT'}")
    return 0 if ok else 1


# -- upstream's tests, offline, unpatched and patched -------------------------------


# A made-up commit: the stand-ins live in a Hugging Face cache of their own,
# so upstream's ``load`` finds them through the real offline hub lookup.
STANDIN_REVISION = "0" * 40


def hub_cache(work: Path) -> Path:
    return work / "hf-home" / "hub"


def build_hub_standins(work: Path) -> Dict[str, str]:
    """Tiny local models for every hub repo the upstream tests load, written
    into the Hugging Face cache under ``work`` (``hub_cache``)."""
    from . import tiny

    out = {}
    for repo, spec in HUB_MODELS.items():
        entry = hub_cache(work) / f"models--{repo.replace('/', '--')}"
        path = entry / "snapshots" / STANDIN_REVISION
        if not (path / "config.json").exists():
            _tiny_model_dir(path, tiny, **spec)
            (entry / "refs").mkdir(exist_ok=True)
            (entry / "refs" / "main").write_text(STANDIN_REVISION)
        out[repo] = str(path)
    return out


def _tiny_model_dir(path: Path, tiny, family, config, quantize, dtype) -> Path:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    config = tiny.model_config(family, **config)
    model = tiny.build_model(config, seed=0, dtype=dtype)
    if quantize:
        nn.quantize(model, **quantize)
        config["quantization"] = dict(quantize)
        config["quantization_config"] = dict(quantize)
    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in weights}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tiny.write_tokenizer(path)
    _swap_token_ids(path / "tokenizer.json", "!", "<|endoftext|>")
    return path


def _swap_token_ids(path: Path, a: str, b: str):
    """Give ``a`` the id of ``b`` and back: the Qwen vocabulary upstream's
    tests assume starts with ``!`` (id 0)."""
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    ids = {t["content"]: t for t in data["added_tokens"]}
    ia = ids[a]["id"] if a in ids else vocab[a]
    ib = ids[b]["id"] if b in ids else vocab[b]
    for token, new in ((a, ib), (b, ia)):
        if token in ids:
            ids[token]["id"] = new
        if token in vocab:
            vocab[token] = new
    path.write_text(json.dumps(data, ensure_ascii=False))


# pytest plugin (``-p mlx_lm_patched.upstream``), active when MODELS_ENV is set.
_results: Dict[str, dict] = {}
_RANK = {"passed": 0, "xfailed": 0, "skipped": 1, "failed": 2, "error": 2}


def pytest_configure(config):
    if not os.environ.get(MODELS_ENV):
        return
    import mlx_lm_patched

    want = os.environ.get("MLX_LM_PATCHED_APPLY", "1") != "0"
    applied = list(_registry._applied)
    expected = [p.name for p in mlx_lm_patched.PATCHES] if want else []
    if applied != expected:
        raise RuntimeError(f"patches applied {applied}, expected {expected}")
    _results["__applied__"] = {"outcome": "meta", "reason": ",".join(applied)}


def _reason(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    text = text.strip().splitlines()[0] if text.strip() else ""
    ctx = getattr(report, "context", None)
    msg = getattr(ctx, "msg", None) if ctx is not None else None
    kwargs = getattr(ctx, "kwargs", None) if ctx is not None else None
    if msg or kwargs:
        text = f"[subtest {msg or ''} {kwargs or ''}".rstrip() + f"] {text}"
    return text[:300]


def _record(nodeid: str, outcome: str, reason: str):
    rec = _results.setdefault(nodeid, {"outcome": "passed", "reason": ""})
    if _RANK[outcome] > _RANK[rec["outcome"]] or (
        outcome == "xfailed" and rec["outcome"] == "passed"
    ):
        rec["outcome"], rec["reason"] = outcome, reason


def pytest_runtest_logreport(report):
    if not os.environ.get(MODELS_ENV):
        return
    if hasattr(report, "wasxfail"):
        _record(
            report.nodeid, "xfailed" if report.skipped else "passed", report.wasxfail
        )
    elif report.failed:
        _record(
            report.nodeid,
            "failed" if report.when == "call" else "error",
            _reason(report),
        )
    elif report.skipped:
        _record(report.nodeid, "skipped", _reason(report))
    else:
        _record(report.nodeid, "passed", "")


def pytest_collectreport(report):
    if os.environ.get(MODELS_ENV) and report.failed:
        _record(report.nodeid or "<collection>", "error", _reason(report))


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get(REPORT_ENV)
    if os.environ.get(MODELS_ENV) and path:
        Path(path).write_text(json.dumps(_results, indent=1, sort_keys=True))


@dataclass
class Run:
    label: str
    results: Dict[str, dict]
    returncode: int
    log: Path

    @property
    def applied(self) -> str:
        return self.results.get("__applied__", {}).get("reason", "")

    def tests(self) -> Dict[str, dict]:
        return {k: v for k, v in self.results.items() if k != "__applied__"}


def run_upstream_tests(
    files: Sequence[str],
    patched: bool,
    work: Path,
    models: Dict[str, str],
    extra: Sequence[str] = (),
    timeout: float = 1800,
) -> Run:
    label = "patched" if patched else "unpatched"
    hub_cache(work).mkdir(parents=True, exist_ok=True)
    report = work / f"{label}.json"
    log = work / f"{label}.log"
    env = dict(os.environ)
    env.update(
        {
            MODELS_ENV: json.dumps(models),
            REPORT_ENV: str(report),
            "MLX_LM_PATCHED_APPLY": "1" if patched else "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_HOME": str(hub_cache(work).parent),
            "HF_HUB_CACHE": str(hub_cache(work)),
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(ROOT), env.get("PYTHONPATH", "")])
            ),
        }
    )
    cmd = [sys.executable, "-m", "pytest", "-p", "mlx_lm_patched.upstream"]
    cmd += ["-p", "no:cacheprovider", "-q", "--no-header", "-rN"]
    cmd += ["--continue-on-collection-errors", *extra, *files]
    with open(log, "w") as f:
        try:
            r = subprocess.run(
                cmd,
                cwd=work / "tests",
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            )
            rc = r.returncode
        except subprocess.TimeoutExpired:
            rc = -1
    results = json.loads(report.read_text()) if report.exists() else {}
    return Run(label, results, rc, log)


def _counts(tests: Dict[str, dict], file: str) -> Counter:
    return Counter(v["outcome"] for k, v in tests.items() if k.split("::")[0] == file)


def _fmt(c: Counter) -> str:
    failed = c["failed"] + c["error"]
    return f"{c['passed'] + c['xfailed']:4d} passed {failed:3d} failed {c['skipped']:3d} skipped"


def compare_runs(
    files: Sequence[str], base: Run, patched: Run, accepted=None
) -> Tuple[List[str], str]:
    """(regressions, report text): no test may do worse patched than
    unpatched, except those ``accepted`` (default ``ACCEPTED_CHANGES``)."""
    accepted = ACCEPTED_CHANGES if accepted is None else accepted
    a, b = base.tests(), patched.tests()
    lines = [
        f"upstream tests of mlx-lm {UPSTREAM_VERSION}, offline (tiny stand-in models)"
    ]
    lines.append(f"patches applied in the patched run: {patched.applied or 'none'}")
    lines.append(f"{'file':24} {'unpatched':>34}   {'patched':>34}")
    for file in files:
        lines.append(f"{file:24} {_fmt(_counts(a, file))}   {_fmt(_counts(b, file))}")
    worse, better, both, known = [], [], [], []
    for nodeid in sorted(set(a) | set(b)):
        ra, rb = a.get(nodeid), b.get(nodeid)
        if nodeid in accepted and rb is not None and ra is not None:
            if _RANK[rb["outcome"]] > _RANK[ra["outcome"]]:
                known.append(f"{nodeid}: {rb['reason']} (accepted: {accepted[nodeid]})")
                continue
        if rb is None:
            worse.append(f"{nodeid}: {ra['outcome']} unpatched, not run patched")
            continue
        if ra is None:
            continue
        if _RANK[rb["outcome"]] > _RANK[ra["outcome"]]:
            worse.append(
                f"{nodeid}: {ra['outcome']} unpatched, {rb['outcome']} patched: {rb['reason']}"
            )
        elif _RANK[rb["outcome"]] < _RANK[ra["outcome"]]:
            better.append(
                f"{nodeid}: {ra['outcome']} unpatched, {rb['outcome']} patched"
            )
        elif _RANK[ra["outcome"]] == 2:
            why = ra["reason"]
            if rb["reason"] != ra["reason"]:
                why += f" | patched: {rb['reason']}"
            both.append(f"{nodeid}: {why}")
    for title, items in (
        ("WORSE patched than unpatched", worse),
        ("worse patched, accepted (ACCEPTED_CHANGES)", known),
        ("better patched than unpatched", better),
        ("failing in both runs", both),
    ):
        lines.append(f"{title}: {len(items)}")
        lines += [f"  {item}" for item in items]
    for run in (base, patched):
        if run.returncode not in (0, 1):
            lines.append(
                f"note: the {run.label} run exited {run.returncode} (log {run.log})"
            )
    return worse, "\n".join(lines)


def cmd_test(args) -> int:
    tree = sdist_tree()
    files = args.files or list(TEST_FILES)
    if not args.files and importlib.util.find_spec("requests") is None:
        files.remove("test_server.py")
        print(
            "test: leaving out test_server.py, which needs `requests`", file=sys.stderr
        )
    for f in files:
        if not (tree / "tests" / f.split("::")[0]).exists():
            print(
                f"test: no tests/{f} in the mlx-lm {UPSTREAM_VERSION} sdist",
                file=sys.stderr,
            )
            return 2
    work = Path(tempfile.mkdtemp(prefix="mlx-lm-upstream-tests-"))
    shutil.copytree(tree / "tests", work / "tests")
    models = build_hub_standins(work)
    extra = ["-k", args.k] if args.k else []
    runs = [run_upstream_tests(files, p, work, models, extra) for p in (False, True)]
    for run in runs:
        if not run.results:
            print(
                f"test: the {run.label} run reported nothing; see {run.log}",
                file=sys.stderr,
            )
            print(run.log.read_text()[-3000:], file=sys.stderr)
            return 2
    worse, text = compare_runs([f.split("::")[0] for f in files], *runs)
    print(text)
    print(f"logs: {work}")
    return 1 if worse else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_lm_patched.upstream")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("patches", help="write patches/ from PATCHES")
    sub.add_parser("check-patches", help="fail if patches/ is stale or does not apply")
    p = sub.add_parser("vendor", help="build the patched mlx-lm wheel into dist/")
    p.add_argument("--out", default=str(DIST_DIR))
    p = sub.add_parser("test", help="upstream's tests, unpatched vs patched")
    p.add_argument(
        "files", nargs="*", help=f"test files (default: {' '.join(TEST_FILES)})"
    )
    p.add_argument("-k", help="pytest -k expression")
    p = sub.add_parser(
        "check-release", help="do the patches fit another mlx-lm release"
    )
    p.add_argument(
        "version",
        nargs="?",
        default="latest",
        help="an mlx-lm version (default: latest)",
    )
    args = parser.parse_args(argv)
    handler = {
        "patches": cmd_patches,
        "check-patches": cmd_check_patches,
        "vendor": cmd_vendor,
        "test": cmd_test,
        "check-release": cmd_check_release,
    }[args.command]
    try:
        return handler(args)
    except (UpstreamUnavailable, GenerateError) as e:
        print(f"{args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
