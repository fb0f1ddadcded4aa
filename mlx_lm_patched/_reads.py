"""What a patch's code reads: attribute names off the bytecode, and the
attributes upstream's classes have (so the others must come from a patch)."""

import dis
import functools
import importlib
import inspect
import sys
import types
from typing import Any, Callable, Dict, List, Tuple

from ._merge import functions

# Attribute opcodes, and the shift of their argument to the name's index
# (3.12 packs flags into LOAD_ATTR's low bit, LOAD_SUPER_ATTR's low two).
_READS = {
    dis.opmap[n]: int(n == "LOAD_ATTR" and sys.version_info >= (3, 12))
    + 2 * (n == "LOAD_SUPER_ATTR")
    for n in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR")
    if n in dis.opmap
}
_STORE_ATTR, _EXTENDED_ARG = dis.opmap["STORE_ATTR"], dis.opmap["EXTENDED_ARG"]


@functools.lru_cache(maxsize=None)
def attributes(code: types.CodeType) -> Tuple[frozenset, frozenset]:
    """The attribute names ``code`` (and the code nested in it) reads, and
    those it sets: read off the bytecode as ``_merge._global_reads`` does."""
    reads, sets, raw, ext = set(), set(), code.co_code, 0
    for i in range(0, len(raw), 2):
        op, arg = raw[i], raw[i + 1] | ext
        ext = arg << 8 if op == _EXTENDED_ARG else 0
        if op in _READS:
            reads.add(code.co_names[arg >> _READS[op]])
        elif op == _STORE_ATTR:
            sets.add(code.co_names[arg])
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            more = attributes(const)
            reads |= more[0]
            sets |= more[1]
    return frozenset(reads), frozenset(sets)


_fields: Dict[frozenset, frozenset] = {}


def upstream_fields(
    modules: frozenset, upstream: Callable[[str, type], Dict[str, Any]]
) -> frozenset:
    """The attributes upstream's classes in ``modules`` define or their
    methods set, ``upstream(owner, cls)`` giving a class's own attributes as
    upstream has them; found once."""
    if modules not in _fields:
        out = set()
        for module in modules:
            for cls in vars(importlib.import_module(module)).values():
                if not inspect.isclass(cls) or cls.__module__ != module:
                    continue
                for attr, obj in upstream(f"{module}:{cls.__qualname__}", cls).items():
                    out.add(attr)
                    for fn in functions(obj):
                        if isinstance(fn, types.FunctionType):
                            out |= attributes(fn.__code__)[1]
        _fields[modules] = frozenset(out)
    return _fields[modules]


def attribute_needs(targets: List[Any], fields: Dict[str, set], upstream) -> set:
    """The class attributes ``targets``' code reads that upstream lacks
    (``upstream``) and other patches add (``fields``: attribute -> the
    targets adding it), on the class ``targets`` patch where one adds it
    there. Instance state other patches read is declared as such a field
    (``checkpoints = ()``), so its patch is known."""
    own = {t.attr for t in targets if ":" in t.owner}
    mine = {t.name for t in targets}
    out = set()
    for t in targets:
        for fn in functions(t.new):
            for attr in attributes(fn.__code__)[0] - own - upstream:
                found = fields.get(attr, set()) - mine
                here = {f for f in found if f.startswith(t.owner + ".")}
                out |= here or found
    return out


def check_order(patches: List[Any], needs: Callable[[Any], List[str]]):
    """Raise if a patch ``needs`` an object only a later patch provides:
    reverting or setting aside that one would leave it failing."""
    provider = {t.name: p.name for p in patches for t in p.targets}
    seen: set = set()
    for patch in patches:
        later = [n for n in needs(patch) if provider.get(n, patch.name) not in seen]
        later = [n for n in later if provider.get(n, patch.name) != patch.name]
        if later:
            raise ValueError(f"patch {patch.name!r} reads {later}, of later patches")
        seen.add(patch.name)
