"""A change, not a copy: each patched upstream function merged onto the
installed source, three ways, as ``git merge-file`` does (and the source
helpers that takes: fingerprints, the names code reads).

For every upstream function or method a patch changes, ``bases.json`` keeps
the fingerprint of the source it was written against and the lines where
that source differs from ours (``python -m tools patches`` writes it from
the pinned release), so the base is rebuilt from our code. Where the
installed mlx-lm has that source, ours is installed as it is. Where it has
other source, base, ours and theirs are merged with ``merge3`` and the
result is compiled in upstream's module, registered with ``linecache`` so
tracebacks show it. Only a real conflict (upstream changed lines we change,
or removed the object) sets the object aside.
"""

import dis
import functools
import hashlib
import inspect
import json
import linecache
import sys
import textwrap
import types
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import merge3

BASES_FILE = Path(__file__).with_name("bases.json")


def source_of(obj: Any) -> str:
    """The dedented source of a function, a property or a class."""
    if isinstance(obj, property):
        parts = [f for f in (obj.fget, obj.fset) if f is not None]
        return "".join(source_of(f) for f in parts)
    if isinstance(obj, (staticmethod, classmethod)):
        obj = obj.__func__
    return textwrap.dedent(inspect.getsource(obj))


def fingerprint_source(source: str) -> str:
    """A short hash of source text, blank lines and comments kept."""
    return hashlib.sha256(source.encode()).hexdigest()[:12]


def fingerprint(obj: Any) -> str:
    """``fingerprint_source`` of an object's source (``source_of``)."""
    return fingerprint_source(source_of(obj))


def _names(code: types.CodeType) -> set:
    """Every name ``code`` (and the code nested in it) uses: global reads,
    attributes and more; a cheap superset of ``_global_reads``."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


_LOAD_GLOBAL, _LOAD_NAME, _EXTENDED_ARG = (
    dis.opmap[n] for n in ("LOAD_GLOBAL", "LOAD_NAME", "EXTENDED_ARG")
)
# From 3.11 LOAD_GLOBAL's argument is its name's index shifted by one.
_GLOBAL_SHIFT = int(sys.version_info >= (3, 11))


@functools.lru_cache(maxsize=None)
def _global_reads(code: types.CodeType) -> frozenset:
    """Global names ``code`` (and the code nested in it) reads: what
    ``dis.get_instructions`` says, read off the bytecode (ten times faster,
    and every patched function is read at import)."""
    names, raw, ext = set(), code.co_code, 0
    for i in range(0, len(raw), 2):
        op, arg = raw[i], raw[i + 1] | ext
        ext = arg << 8 if op == _EXTENDED_ARG else 0
        if op == _LOAD_GLOBAL:
            names.add(code.co_names[arg >> _GLOBAL_SHIFT])
        elif op == _LOAD_NAME:
            names.add(code.co_names[arg])
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_reads(const)
    return frozenset(names)


class MergeConflict(Exception):
    """Upstream changed lines a patch changes too."""


@functools.lru_cache(maxsize=None)
def bases() -> Dict[str, dict]:
    """``{key: {"fingerprint": ..., "delta": ...}}`` (see ``base_key``)."""
    if not BASES_FILE.exists():
        return {}
    return json.loads(BASES_FILE.read_text())["objects"]


def base_key(owner: str, attr: str) -> str:
    """``mlx_lm.models.cache:RotatingKVCache.trim``, ``mlx_lm.generate:main``."""
    return f"{owner}.{attr}" if ":" in owner else f"{owner}:{attr}"


def delta(ours: Sequence[str], base: Sequence[str]) -> List[list]:
    """The edits that turn ``ours`` back into ``base``: ``[start, end, lines]``,
    our lines ``[start, end)`` replaced by base's ``lines``."""
    import difflib

    ops = difflib.SequenceMatcher(None, ours, base, autojunk=False).get_opcodes()
    return [[i1, i2, list(base[j1:j2])] for op, i1, i2, j1, j2 in ops if op != "equal"]


def rebuild(ours: Sequence[str], edits: Sequence[list]) -> List[str]:
    """The base source, from ours and its ``delta``."""
    out, at = [], 0
    for start, end, lines in edits:
        out += ours[at:start] + list(lines)
        at = end
    return out + list(ours[at:])


def merge(base: str, ours: str, theirs: str, where: str) -> str:
    """``ours`` merged onto ``theirs``; ``MergeConflict`` names the lines both
    sides changed (1-based, in the base source)."""
    b, o, t = (s.splitlines(True) for s in (base, ours, theirs))
    out, conflicts = [], []
    for region in merge3.Merge3(b, o, t).merge_regions():
        kind, *span = region
        if kind == "unchanged":
            out += b[span[0] : span[1]]
        elif kind in ("a", "same"):
            out += o[span[0] : span[1]]
        elif kind == "b":
            out += t[span[0] : span[1]]
        else:
            z0, z1, a0, a1, t0, t1 = span
            now = " / ".join(line.strip() for line in t[t0:t1] if line.strip())
            conflicts.append(
                f"base lines {z0 + 1}-{z1} changed by both (ours: lines "
                f"{a0 + 1}-{a1}; upstream now: {now[:160]!r})"
            )
    if conflicts:
        raise MergeConflict(f"{where}: " + "; ".join(conflicts))
    return "".join(out)


def parse_diff(diff: str) -> List[Tuple[List[str], List[str]]]:
    """The hunks of a unified diff of one function, ``(before, after)``: the
    lines each ``@@`` hunk finds and what it puts there (the numbers in the
    ``@@`` line are not read; a blank line is a blank line of context)."""
    hunks: List[Tuple[List[str], List[str]]] = []
    for line in diff.lstrip("\n").splitlines(True):
        if line.startswith("@@"):
            hunks.append(([], []))
            continue
        if not line.strip():
            line = " \n"
        if not hunks or line[0] not in " -+":
            raise ValueError(f"not a line of a diff hunk: {line!r}")
        before, after = hunks[-1]
        if line[0] in " -":
            before.append(line[1:])
        if line[0] in " +":
            after.append(line[1:])
    if not hunks or not all(before for before, _ in hunks):
        raise ValueError("a diff hunk must find some lines")
    return hunks


def apply_hunks(source: str, hunks, where: str) -> str:
    """``source`` with each hunk's lines replaced by its new ones; a hunk must
    find its lines exactly, once, anywhere (an offset is fine), else
    ``MergeConflict``."""
    lines = source.splitlines(True)
    for i, (before, after) in enumerate(hunks, 1):
        n = len(before)
        at = [k for k in range(len(lines) - n + 1) if lines[k : k + n] == before]
        if len(at) != 1:
            first = next((b.strip() for b in before if b.strip()), "")
            found = f"found {len(at)} times" if at else "no longer found"
            raise MergeConflict(f"{where}: hunk {i} (at {first[:60]!r}) {found}")
        lines[at[0] : at[0] + n] = after
    return "".join(lines)


def compile_merged(
    source: str, namespace: dict, cls: Optional[type], name: str, where: str
) -> Any:
    """The object ``source`` defines as ``name``, compiled in ``namespace``
    (an upstream module's); the source is kept in ``linecache`` under a file
    name saying what it is. A method using ``super()`` is compiled in a class
    body and bound to ``cls``; a method's annotations see ``cls``'s names, as
    in its class body (``-> List[Response]``)."""
    wrap = cls is not None and "super(" in source
    if wrap:
        source = f"class {cls.__name__}:\n" + "".join(
            "    " + line if line.strip() else line for line in source.splitlines(True)
        )
    filename = f"<mlx_lm_patched: {where}, {fingerprint_source(source)}>"
    lines = source.splitlines(True)
    linecache.cache[filename] = (len(source), None, lines, filename)
    local: Dict[str, Any] = dict(vars(cls)) if cls is not None and not wrap else {}
    exec(compile(source, filename, "exec"), namespace, local)
    obj = vars(local[cls.__name__])[name] if wrap else local[name]
    for fn in functions(obj) if cls is not None else ():
        for var, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            if var == "__class__":
                cell.cell_contents = cls
        fn.__qualname__ = f"{cls.__qualname__}.{fn.__name__}"
    return obj


def functions(obj) -> List[types.FunctionType]:
    """The functions that run ``obj``'s code: itself, a property's accessors,
    a class's methods."""
    if isinstance(obj, property):
        return [f for f in (obj.fget, obj.fset) if f is not None]
    if isinstance(obj, (classmethod, staticmethod)):
        return [obj.__func__]
    if isinstance(obj, types.FunctionType):
        return [obj]
    if isinstance(obj, type):
        return [f for v in vars(obj).values() for f in functions(v)]
    return []
