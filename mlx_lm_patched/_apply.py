"""Patches applied whole, or set aside, and reverted with what needs them.

A patch needs the objects of other patches its code reads: global names,
and class attributes upstream lacks, read off the bytecode. A patch whose
targets cannot all be installed (a conflict with the installed upstream, a
name it uses gone, an object it needs not installed) is set aside with a
``PatchDriftWarning`` (``PatchDriftError`` with ``strict=True``), and so are
the patches that need it; its helpers stay installed for the patches that
use them. Reverting one reverts the patches that need it, or that stack an
edit on it, with it.
"""

import dis
import functools
import importlib
import inspect
import sys
import types
import warnings
from importlib.metadata import PackageNotFoundError, version
from typing import Dict, List, Tuple

from . import _merge, _newmods, _registry
from ._merge import MergeConflict, _global_reads, _names, functions
from ._registry import _MISSING, UPSTREAM_VERSION, Edit, Patch, Target


class PatchDriftWarning(UserWarning):
    """An upstream object a patch replaces is not the one it was written for."""


class PatchDriftError(RuntimeError):
    """Raised instead of ``PatchDriftWarning`` when applying with ``strict=True``."""


# Per patch with anything installed, in apply order: its installed targets.
_patches: Dict[str, List[Target]] = {}
_applied: Dict[str, Patch] = {}  # the patches installed whole
_merged: Dict[str, List[str]] = {}  # per applied patch, its targets merged

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


def is_applied(name: str) -> bool:
    return name in _applied


def installed_version() -> str:
    return version("mlx-lm")


def vendored() -> bool:
    """Whether the installed mlx-lm is a wheel with the series in its source
    (``make vendor``: ``<release>+patched.N``), so nothing is applied to it.
    An mlx_lm imported from a source tree may have no version, or none
    installed: not vendored."""
    try:
        return "+patched." in (installed_version() or "")
    except PackageNotFoundError:
        return False


def check_disjoint(patches: List[Patch]):
    """Raise if two patches replace the same attribute, or one targets an
    attribute twice: a later patch may only stack an ``Edit`` on it."""
    owners: Dict[Tuple[str, str], str] = {}
    for patch in patches:
        keys = [t.key for t in patch.targets]
        for t in patch.targets:
            other = owners.setdefault(t.key, patch.name)
            if keys.count(t.key) > 1 or (
                other != patch.name and not isinstance(t.new, Edit)
            ):
                raise ValueError(
                    f"patches {other!r} and {patch.name!r} both replace "
                    f"{t.owner}.{t.attr}"
                )


def check_requires(patches: List[Patch]):
    """Raise if a patch requires what no patch before it provides."""
    known: set = set()
    for patch in patches:
        unknown = [r for r in patch.requires if r not in known]
        if unknown:
            raise ValueError(f"patch {patch.name!r} requires unknown {unknown}")
        known |= {patch.name} | {t.name for t in patch.targets}


def check_needs(patches: List[Patch]):
    """Raise if a patch's code reads an object (a global name, a class
    attribute) that only a later patch provides: reverting or setting aside
    that one would leave it failing."""
    provider = {t.name: p.name for p in patches for t in p.targets}
    seen: set = set()
    for patch in patches:
        needs = _needs(patch.targets) + sorted(_attribute_needs(patch.targets))
        later = [n for n in needs if provider.get(n, patch.name) not in seen]
        later = [n for n in later if provider.get(n, patch.name) != patch.name]
        if later:
            raise ValueError(f"patch {patch.name!r} reads {later}, of later patches")
        seen.add(patch.name)


def _is_helper(t: Target) -> bool:
    """A new module-level object that is not a class: inert until called, it
    stays installed for the patches that use it when its own patch cannot."""
    added = ":" not in t.owner and t.fingerprint is None
    lazy = isinstance(t.new, Edit) or (
        _newmods.lazy(t.new) and not _newmods.helpers_only(t.new)
    )
    return added and not inspect.isclass(t.new) and not lazy


def _needs(targets: List[Target]) -> List[str]:
    """The objects (``Target.name``) other patches add that ``targets``' code
    reads as global names."""
    adds, out = _registry._adds, set()
    for t in targets:
        if isinstance(t.new, Edit):
            module = t.owner.partition(":")[0]
            reads = adds.get(module, set()) & t.new.reads()
            out.update(_merge.base_key(module, n) for n in reads)
        for fn in functions(t.new):
            module = fn.__globals__.get("__name__")
            added = adds.get(module, set()) & _names(fn.__code__)
            out.update(
                _merge.base_key(module, n) for n in added & _global_reads(fn.__code__)
            )
        out.update(_newmods.needs(adds, t.new))
    return sorted(out - {t.name for t in targets})


_fields_found: Dict[frozenset, frozenset] = {}


def _upstream_fields(modules: frozenset) -> frozenset:
    """The attributes upstream's classes in ``modules`` define or their
    methods set, as upstream has them (its originals where patched); found
    once."""
    if modules not in _fields_found:
        out = set()
        for module in modules:
            for cls in vars(importlib.import_module(module)).values():
                if not inspect.isclass(cls) or cls.__module__ != module:
                    continue
                owner = f"{module}:{cls.__qualname__}"
                saved = {a: v for (o, a), v in _registry._saved.items() if o == owner}
                for attr, obj in {**vars(cls), **saved}.items():
                    if obj is _MISSING:
                        continue
                    out.add(attr)
                    for fn in functions(obj):
                        if isinstance(fn, types.FunctionType):
                            out |= attributes(fn.__code__)[1]
        _fields_found[modules] = frozenset(out)
    return _fields_found[modules]


def _attribute_needs(targets: List[Target]) -> set:
    """The class attributes ``targets``' code reads that upstream lacks and
    other patches add (``_registry._fields``), on the class ``targets``
    patch where one adds it there. Instance state other patches read is
    declared as such a field (``checkpoints = ()``), so its patch is known."""
    upstream = _upstream_fields(frozenset(_registry._modules))
    own = {t.attr for t in targets if ":" in t.owner}
    mine = {t.name for t in targets}
    out = set()
    for t in targets:
        for fn in functions(t.new):
            for attr in attributes(fn.__code__)[0] - own - upstream:
                found = _registry._fields.get(attr, set()) - mine
                here = {f for f in found if f.startswith(t.owner + ".")}
                out |= here or found
    return out


def requirements(patch: Patch) -> List[str]:
    """What ``patch`` needs: its ``requires`` (patches or objects, by name)
    and the objects of other patches its code reads (global names and class
    attributes; its helpers alone read only their arguments' attributes)."""
    needs = set(_needs(patch.targets)) | _attribute_needs(patch.targets)
    return sorted(set(patch.requires) | needs)


def _is_installed(name: str) -> bool:
    """A patch installed whole, or an object (``Target.name``) installed."""
    installed = _registry._installed
    return name in _applied or any(_merge.base_key(*k) == name for k in installed)


def apply_patches(patches: List[Patch], strict: bool = False) -> List[str]:
    """Apply ``patches`` in order; return the names that are applied now.

    A patch whose targets cannot all be installed is set aside whole with
    one warning saying why; its helpers (``_is_helper``) stay installed
    where their own needs are met."""
    check_disjoint(
        list(_applied.values()) + [p for p in patches if p.name not in _applied]
    )
    below: Dict[Tuple[str, str], List[str]] = {}  # the patches targeting a key
    for patch in patches:
        stacks_on = {
            name: t
            for t in patch.targets
            for name in below.get(t.key, ())
            if isinstance(t.new, Edit)
        }
        for t in patch.targets:
            below.setdefault(t.key, []).append(patch.name)
        if patch.name in _applied:
            continue
        resolved, problems, helper_problems = {}, [], []
        helpers = [t for t in patch.targets if _is_helper(t)]
        for t in patch.targets:
            try:
                resolved[t.key] = t.resolve()
            except MergeConflict as e:
                (helper_problems if t in helpers else problems).append(str(e))
        problems += helper_problems + patch.unbound()
        own = {t.name for t in patch.targets}
        problems += [
            f"needs {r}, which is not applied"
            for r in requirements(patch)
            if r not in own and not _is_installed(r)
        ]
        problems += [
            f"edits {t.name} as patch {name!r} leaves it, which is not applied"
            for name, t in stacks_on.items()
            if name not in _applied
        ]
        # Alone, the helpers must find what they read installed already.
        helper_problems += [r for r in _needs(helpers) if not _is_installed(r)]
        if problems:
            msg = (
                f"mlx_lm_patched: patch {patch.name!r} not applied "
                f"(written for mlx-lm {UPSTREAM_VERSION}, installed "
                f"{installed_version()}): " + "; ".join(problems)
            )
            if strict:
                raise PatchDriftError(msg)
            if helpers and not helper_problems:
                for t in helpers:
                    if t.key not in _registry._installed:
                        _registry.install(t, resolved[t.key][0])
                _patches[patch.name] = helpers
                msg += f" (its helpers {[t.attr for t in helpers]} stay installed)"
            warnings.warn(msg, PatchDriftWarning, stacklevel=3)
            continue
        for t in patch.targets:
            _registry.install(t, resolved[t.key][0])
        _patches[patch.name] = list(patch.targets)
        _applied[patch.name] = patch
        _merged[patch.name] = [
            t.name for t in patch.targets if resolved[t.key][1] == "merged"
        ]
    return list(_applied)


def dependents(names) -> List[str]:
    """The installed patches that need any of ``names`` or of the objects
    they provide, directly or not, or that stack an edit on one of those."""
    gone = set(names)
    for name in names:
        gone.update(t.name for t in _patches.get(name, ()))
    found = []
    for name, targets in _patches.items():  # in apply order
        patch = _applied.get(name)
        needs = set(requirements(patch) if patch else _needs(targets))
        if name not in gone and (needs & gone or _stacked_on(targets, gone)):
            found.append(name)
            gone.add(name)
            gone.update(t.name for t in targets)
    return found


def _stacked_on(targets: List[Target], gone: set) -> bool:
    """Whether an edit among ``targets`` is installed on a layer of a patch
    in ``gone``."""
    for t in targets:
        layers = [s for s, _ in _registry._stack.get(t.key, ())]
        mine = next((i for i, s in enumerate(layers) if s is t), 0)
        if any(p in gone for s in layers[:mine] for p in _owner_of(s)):
            return True
    return False


def _owner_of(target: Target) -> List[str]:
    return [n for n, ts in _patches.items() if any(t is target for t in ts)]


def revert_patches(patches: List[Patch]) -> List[str]:
    """Put back the upstream objects, last applied first; patches that need
    a reverted one are reverted with it. Returns the names reverted."""
    names = [p.name for p in patches if p.name in _patches]
    names += dependents(names)
    for name in reversed([n for n in _patches if n in names]):
        for t in reversed(_patches.pop(name)):
            _registry.uninstall(t)
        _applied.pop(name, None)
        _merged.pop(name, None)
    return names
