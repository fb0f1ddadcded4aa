"""The patch registry: owns every upstream object a patch replaces.

A ``Patch`` is a named set of ``Target``s. Each target names an attribute of
an upstream class or module, the object that replaces it, and the source
fingerprint of the upstream object it was written against (``None`` for an
attribute upstream does not have), read from ``bases.json`` (``_merge``).
Where the installed source differs, our change is merged onto it three ways;
a target that cannot be merged is never overridden silently: the patch is
set aside with a ``PatchDriftWarning`` (``PatchDriftError`` with
``strict=True``), and so are the patches that need an object it provides.
A patch's new module-level helpers stay installed for the patches that use
them.
"""

import builtins
import importlib
import inspect
import sys
import types
import warnings
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _merge, _reads
from ._merge import (
    MergeConflict,
    _global_reads,
    _names,
    fingerprint,
    fingerprint_source,
    functions,
    source_of,
)

UPSTREAM_VERSION = "0.32.2"


class PatchDriftWarning(UserWarning):
    """An upstream object a patch replaces is not the one it was written for."""


class PatchDriftError(RuntimeError):
    """Raised instead of ``PatchDriftWarning`` when applying with ``strict=True``."""


_MISSING = object()
REMOVED = object()  # ``Target.new`` for an upstream attribute a patch deletes
FROM_BASES = object()  # ``Target.fingerprint``: the one ``bases.json`` records


@dataclass(frozen=True)
class Target:
    owner: str  # "mlx_lm.models.cache:RotatingKVCache", or a module
    attr: str
    new: Any
    # The upstream source it was written against; None: upstream has none.
    fingerprint: Optional[str] = FROM_BASES  # type: ignore[assignment]

    def __post_init__(self):
        if self.fingerprint is FROM_BASES:
            entry = _merge.bases().get(self.name, {})
            object.__setattr__(self, "fingerprint", entry.get("fingerprint"))

    def resolve_owner(self):
        module, _, rest = self.owner.partition(":")
        obj = importlib.import_module(module)
        for part in filter(None, rest.split(".")):
            obj = getattr(obj, part)
        return obj

    def upstream(self):
        """The upstream object (inherited ones included), or ``_MISSING``."""
        owner = self.resolve_owner()
        if self.key not in _saved:
            return inspect.getattr_static(owner, self.attr, _MISSING)
        original = _saved[self.key]
        if original is _MISSING and inspect.isclass(owner):
            # Replaced an inherited attribute: look it up past the owner.
            for base in owner.__mro__[1:]:
                if self.attr in base.__dict__:
                    return base.__dict__[self.attr]
        return original

    @property
    def key(self) -> Tuple[str, str]:
        return (self.owner, self.attr)

    @property
    def name(self) -> str:
        """``mlx_lm.models.cache:RotatingKVCache.trim`` (``_merge.base_key``)."""
        return _merge.base_key(self.owner, self.attr)

    def resolve(self) -> Tuple[Any, str]:
        """``(object to install, how)``: ``new`` as written where upstream has
        the source it was written for, else ours merged onto upstream's
        (``"merged"``). Raises ``MergeConflict`` saying why it cannot."""
        try:
            current = self.upstream()
        except (ImportError, AttributeError) as e:
            raise MergeConflict(f"{self.owner} is missing ({e})") from None
        where = self.name.replace(":", ".")
        if self.fingerprint is None:
            if current is _MISSING:
                return self.new, "new"
            raise MergeConflict(f"{where} now exists upstream")
        if current is _MISSING:
            raise MergeConflict(f"{where} is missing upstream")
        found = fingerprint(current)
        if found == self.fingerprint:
            return self.new, "as written"
        changed = (
            f"{where} changed (fingerprint {found}, written for {self.fingerprint})"
        )
        edits = _merge.bases().get(self.name, {}).get("delta")
        if self.new is REMOVED or edits is None:
            raise MergeConflict(changed)
        ours = source_of(self.new)
        base = "".join(_merge.rebuild(ours.splitlines(True), edits))
        if fingerprint_source(base) != self.fingerprint:
            raise MergeConflict(f"{changed}; bases.json is out of date")
        merged = _merge.merge(base, ours, source_of(current), where)
        fn = _merge.functions(self.new)[0]
        owner = self.resolve_owner()
        cls = owner if inspect.isclass(owner) else None
        new = _merge.compile_merged(merged, fn.__globals__, cls, fn.__name__, where)
        gone = _unbound(new, fn.__globals__)
        if gone:
            raise MergeConflict(f"{where} uses {gone}, which upstream no longer has")
        return new, "merged"

    def drift(self) -> Optional[str]:
        """How this target meets upstream, where not as written: merged onto
        changed source, or why it cannot be; ``None`` where as written."""
        try:
            how = self.resolve()[1]
        except MergeConflict as e:
            return str(e)
        return None if how in ("new", "as written") else f"{self.name} merged"


@dataclass
class Patch:
    name: str
    summary: str
    targets: List[Target] = field(default_factory=list)
    # Objects (``Target.name``) or patches this one needs besides the objects
    # of other patches its code reads (``requirements``).
    requires: Tuple[str, ...] = ()

    def __post_init__(self):
        for t in self.targets:
            _modules.add(t.owner.partition(":")[0])
            if ":" not in t.owner and t.fingerprint is None:
                _adds.setdefault(t.owner, set()).add(t.attr)
            elif ":" in t.owner and t.fingerprint is None and t.new is not REMOVED:
                _fields.setdefault(t.attr, set()).add(t.name)

    def unbound(self) -> List[str]:
        """The global names its code reads that neither the module it runs
        in binds nor a patch adds (upstream renamed or removed them)."""
        return [
            f"{fn.__qualname__} uses {gone}, which upstream lacks"
            for t in self.targets
            for fn in functions(t.new)
            if (gone := _unbound(fn, fn.__globals__))
        ]


def _unbound(obj, namespace: dict) -> List[str]:
    """Global names ``obj``'s code reads that ``namespace`` does not bind and
    no patch adds to it (upstream removed them)."""
    module = namespace.get("__name__")
    bound = namespace.keys() | vars(builtins).keys() | _adds.get(module, set())
    out = set()
    for f in functions(obj):
        if _names(f.__code__) - bound:  # else no need to read the bytecode
            out |= _global_reads(f.__code__) - bound
    return sorted(out)


def pasted_into(module: str, obj: Any) -> Any:
    """``obj`` as if its source were pasted into ``module``: its functions (a
    property's accessors too) look their global names up there, so the patch
    runs exactly as its upstream diff would, and a name the module lacks fails."""
    if isinstance(obj, property):
        fget, fset = (f and pasted_into(module, f) for f in (obj.fget, obj.fset))
        return property(fget, fset, doc=obj.__doc__)
    if isinstance(obj, (classmethod, staticmethod)):
        return type(obj)(pasted_into(module, obj.__func__))
    if not isinstance(obj, types.FunctionType):
        return obj
    namespace = vars(importlib.import_module(module))
    fn = types.FunctionType(
        obj.__code__, namespace, obj.__name__, obj.__defaults__, obj.__closure__
    )
    fn.__kwdefaults__, fn.__doc__ = obj.__kwdefaults__, obj.__doc__
    fn.__qualname__, fn.__annotations__ = obj.__qualname__, obj.__annotations__
    fn.__module__ = module
    return fn


def cache_class(module: str, namespace: type, *bases: type) -> type:
    """``namespace`` as a new class of ``module``, its methods pasted there
    (``load_prompt_cache`` finds a cache class by name once it is registered)."""
    body = {
        k: pasted_into(module, v)
        for k, v in vars(namespace).items()
        if k not in ("__dict__", "__weakref__")
    }
    body["__module__"] = module
    return type(namespace.__name__, bases, body)


def class_patch(
    owner: str,
    namespace: type,
    fingerprints: Optional[Dict[str, Optional[str]]] = None,
    removes: Sequence[str] = (),
):
    """Targets for every attribute defined in ``namespace``'s body.

    ``namespace`` is a plain class written like the upstream class it patches
    (``owner`` is ``"module:Class"``); the upstream source each attribute
    replaces is recorded in ``bases.json`` (``fingerprints``, where given,
    must name each attribute instead). ``removes`` names the upstream methods
    the patch makes dead (a dict gives their fingerprints). Methods are
    pasted into the owner's module (see ``pasted_into``). Patches declare
    their targets with ``targets``, which calls this.
    """
    names = [n for n in vars(namespace) if not n.startswith("__") or n == "__init__"]
    if fingerprints is not None and sorted(names) != sorted(fingerprints):
        raise ValueError(
            f"{namespace.__name__}: fingerprints for {sorted(fingerprints)} "
            f"but it defines {sorted(names)}"
        )
    module = owner.partition(":")[0]
    prints = fingerprints or {}
    targets = [
        Target(
            owner,
            n,
            pasted_into(module, vars(namespace)[n]),
            prints.get(n, FROM_BASES) if fingerprints is not None else FROM_BASES,
        )
        for n in names
    ]
    prints = removes if isinstance(removes, dict) else {}
    return targets + [
        Target(owner, n, REMOVED, prints.get(n, FROM_BASES)) for n in removes
    ]


def targets(owner: str, *objects: Any, removes: Sequence[str] = (), **named: Any):
    """The one way a patch declares what it puts where: ``objects`` into
    ``owner``, each under its own name.

    ``owner`` is an upstream module (``"mlx_lm.models.cache"``) or a class
    of one (``"mlx_lm.models.cache:RotatingKVCache"``). Into a module go
    functions (pasted into it, see ``pasted_into``; one pasted into another
    upstream module already is imported from there), classes and modules
    (an import); ``named`` gives plain values their names. Into a class goes
    one plain class written like it: every attribute its body defines
    (``class_patch``). ``removes`` names the attributes the patch deletes.
    Which of them replace upstream objects, and the source each was written
    against, ``bases.json`` records.
    """
    if ":" in owner:
        (namespace,) = objects
        return class_patch(owner, namespace, removes=removes) + [
            Target(owner, k, v) for k, v in named.items()
        ]
    out = []
    for obj in objects:
        if isinstance(obj, types.FunctionType) and not obj.__module__.startswith(
            "mlx_lm."
        ):
            obj = pasted_into(owner, obj)
        out.append(Target(owner, obj.__name__, obj))
    out += [Target(owner, k, v) for k, v in named.items()]
    return out + [Target(owner, n, REMOVED) for n in removes]


# module -> the names patches add to it (upstream has none)
_adds: Dict[str, set] = {}
_modules: set = set()  # the upstream modules patches change
# attribute -> the targets (``Target.name``) that add it to an upstream class
_fields: Dict[str, set] = {}
# (owner, attr) -> the upstream object, or _MISSING where upstream had none
_saved: Dict[Tuple[str, str], Any] = {}
# (owner, attr) -> the object installed there (ours, or ours merged)
_installed: Dict[Tuple[str, str], Any] = {}
# Per patch with anything installed, in apply order: its installed targets.
_patches: Dict[str, List[Target]] = {}
_applied: Dict[str, Patch] = {}  # the patches installed whole
_merged: Dict[str, List[str]] = {}  # per applied patch, its targets merged


def _importers(owner, attr: str, obj) -> List[Any]:
    """Other mlx-lm modules that bound ``obj`` as ``attr`` (``from ... import``)."""
    return [
        mod
        for name, mod in list(sys.modules.items())
        if (name == "mlx_lm" or name.startswith("mlx_lm."))
        and mod is not owner
        and getattr(mod, "__dict__", {}).get(attr) is obj
    ]


def _set(target: Target, new: Any):
    owner = target.resolve_owner()
    original = (
        owner.__dict__.get(target.attr, _MISSING)
        if inspect.isclass(owner)
        else getattr(owner, target.attr, _MISSING)
    )
    if inspect.ismodule(owner) and original is not _MISSING:
        for mod in _importers(owner, target.attr, original):
            setattr(mod, target.attr, new)
    # The first original is kept: two patches never share a target.
    _saved.setdefault(target.key, original)
    _installed[target.key] = new
    if new is REMOVED:
        delattr(owner, target.attr)
    else:
        setattr(owner, target.attr, new)


def _unset(target: Target):
    original = _saved.pop(target.key)
    new = _installed.pop(target.key)
    owner = target.resolve_owner()
    if inspect.ismodule(owner) and original is not _MISSING:
        # Modules imported while patched bound the replacement too.
        for mod in _importers(owner, target.attr, new):
            setattr(mod, target.attr, original)
    if original is _MISSING:
        delattr(owner, target.attr)
    else:
        setattr(owner, target.attr, original)


def get_original(owner: str, attr: str) -> Any:
    """The upstream object behind ``owner.attr``, patched or not."""
    t = Target(owner, attr, None, None)
    found = t.upstream()
    if found is _MISSING:
        raise AttributeError(f"{owner}.{attr} has no upstream original")
    return found


def is_applied(name: str) -> bool:
    return name in _applied


def installed_version() -> str:
    return version("mlx-lm")


def check_disjoint(patches: List[Patch]):
    """Raise if two patches replace the same attribute."""
    owners: Dict[Tuple[str, str], str] = {}
    for patch in patches:
        for t in patch.targets:
            other = owners.setdefault(t.key, patch.name)
            if other != patch.name:
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
    attribute) that only a later patch provides (``_reads.check_order``)."""
    _reads.check_order(
        patches, lambda p: _needs(p.targets) + sorted(_attribute_needs(p.targets))
    )


def _is_helper(t: Target) -> bool:
    """A new module-level object that is not a class: inert until called, it
    stays installed for the patches that use it when its own patch cannot."""
    return ":" not in t.owner and t.fingerprint is None and not inspect.isclass(t.new)


def _needs(targets: List[Target]) -> List[str]:
    """The objects (``Target.name``) other patches add that ``targets``' code
    reads as global names."""
    own = {t.key for t in targets}
    out = set()
    for t in targets:
        for fn in functions(t.new):
            module = fn.__globals__.get("__name__")
            added = _adds.get(module, set()) & _names(fn.__code__)
            out.update(
                _merge.base_key(module, n)
                for n in added & _global_reads(fn.__code__)
                if (module, n) not in own
            )
    return sorted(out)


def _upstream(owner: str, cls: type) -> Dict[str, Any]:
    """``cls``'s attributes (its ``vars``) as upstream defines them."""
    found = {**vars(cls), **{a: v for (o, a), v in _saved.items() if o == owner}}
    return {a: v for a, v in found.items() if v is not _MISSING}


def _attribute_needs(targets: List[Target]) -> set:
    """The class attributes ``targets``' code reads that other patches add
    (``_reads.attribute_needs``)."""
    upstream = _reads.upstream_fields(frozenset(_modules), _upstream)
    return _reads.attribute_needs(targets, _fields, upstream)


def requirements(patch: Patch) -> List[str]:
    """What ``patch`` needs: its ``requires`` (patches or objects, by name)
    and the objects of other patches its code reads (global names and class
    attributes; its helpers alone read only their arguments' attributes)."""
    needs = set(_needs(patch.targets)) | _attribute_needs(patch.targets)
    return sorted(set(patch.requires) | needs)


def _is_installed(name: str) -> bool:
    """A patch installed whole, or an object (``Target.name``) installed."""
    return name in _applied or any(_merge.base_key(*k) == name for k in _installed)


def apply_patches(patches: List[Patch], strict: bool = False) -> List[str]:
    """Apply ``patches`` in order; return the names that are applied now.

    A patch whose targets cannot all be installed (a conflict with the
    installed upstream, a name it uses gone, an object it needs not
    installed) is set aside whole with one warning saying why; its helpers
    (``_is_helper``) stay installed where their own needs are met."""
    check_disjoint(
        list(_applied.values()) + [p for p in patches if p.name not in _applied]
    )
    for patch in patches:
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
                    if t.key not in _installed:
                        _set(t, resolved[t.key][0])
                _patches[patch.name] = helpers
                msg += f" (its helpers {[t.attr for t in helpers]} stay installed)"
            warnings.warn(msg, PatchDriftWarning, stacklevel=3)
            continue
        for t in patch.targets:
            if t.key not in _installed:
                _set(t, resolved[t.key][0])
        _patches[patch.name] = list(patch.targets)
        _applied[patch.name] = patch
        _merged[patch.name] = [
            t.name for t in patch.targets if resolved[t.key][1] == "merged"
        ]
    return list(_applied)


def dependents(names) -> List[str]:
    """The installed patches that need any of ``names`` or of the objects
    they provide, directly or not."""
    gone = set(names)
    for name in names:
        gone.update(t.name for t in _patches.get(name, ()))
    found = []
    for name, targets in _patches.items():  # in apply order
        patch = _applied.get(name)
        needs = set(requirements(patch) if patch else _needs(targets))
        if name not in gone and needs & gone:
            found.append(name)
            gone.add(name)
            gone.update(t.name for t in targets)
    return found


def revert_patches(patches: List[Patch]) -> List[str]:
    """Put back the upstream objects, last applied first; patches that need
    a reverted one are reverted with it. Returns the names reverted."""
    names = [p.name for p in patches if p.name in _patches]
    names += dependents(names)
    for name in reversed([n for n in _patches if n in names]):
        for t in reversed(_patches.pop(name)):
            _unset(t)
        _applied.pop(name, None)
        _merged.pop(name, None)
    return names
