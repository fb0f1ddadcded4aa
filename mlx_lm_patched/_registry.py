"""The patch registry: owns every upstream object a patch replaces.

A ``Patch`` is a named set of ``Target``s. Each target names an attribute of
an upstream class or module, the object that replaces it, and the source
fingerprint of the upstream object it was written against (``None`` for an
attribute upstream does not have). A target whose upstream source changed is
never overridden silently: the patch is skipped with a ``PatchDriftWarning``,
or ``PatchDriftError`` with ``strict=True``.
"""

import builtins
import dis
import hashlib
import importlib
import inspect
import sys
import textwrap
import types
import warnings
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any, Dict, List, Optional, Tuple

UPSTREAM_VERSION = "0.32.2"


class PatchDriftWarning(UserWarning):
    """An upstream object a patch replaces is not the one it was written for."""


class PatchDriftError(RuntimeError):
    """Raised instead of ``PatchDriftWarning`` when applying with ``strict=True``."""


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


_MISSING = object()
REMOVED = object()  # ``Target.new`` for an upstream attribute a patch deletes


@dataclass(frozen=True)
class Target:
    owner: str  # dotted path: "mlx_lm.models.cache.RotatingKVCache"
    attr: str
    new: Any
    fingerprint: Optional[str]  # None: upstream has no such attribute

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

    def drift(self) -> Optional[str]:
        """Why this target no longer matches upstream, or ``None``."""
        try:
            current = self.upstream()
        except (ImportError, AttributeError) as e:
            return f"{self.owner} is missing ({e})"
        where = f"{self.owner.replace(':', '.')}.{self.attr}"
        if self.fingerprint is None:
            return None if current is _MISSING else f"{where} now exists upstream"
        if current is _MISSING:
            return f"{where} is missing upstream"
        found = fingerprint(current)
        if found != self.fingerprint:
            return (
                f"{where} changed (fingerprint {found}, written for {self.fingerprint})"
            )
        return None


@dataclass
class Patch:
    name: str
    summary: str
    targets: List[Target] = field(default_factory=list)
    requires: Tuple[str, ...] = ()
    # Per upstream module, the names the patch's code takes from its namespace
    # (pasted code runs there): checked to exist before the patch is applied.
    uses: Dict[str, Tuple[str, ...]] = field(default_factory=dict)

    def missing_uses(self) -> List[str]:
        """The declared upstream names the installed mlx-lm lacks."""
        missing = []
        for module, names in self.uses.items():
            namespace = vars(importlib.import_module(module))
            missing += [f"{module}.{n} is missing" for n in names if n not in namespace]
        return missing


def _global_reads(code: types.CodeType) -> set:
    """Global names ``code`` (and the code nested in it) reads."""
    names = {
        i.argval
        for i in dis.get_instructions(code)
        if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")
    }
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_reads(const)
    return names


def _functions(obj) -> List[types.FunctionType]:
    """The functions that run ``obj``'s code: itself, a property's accessors,
    a class's methods."""
    if isinstance(obj, property):
        return [f for f in (obj.fget, obj.fset) if f is not None]
    if isinstance(obj, (classmethod, staticmethod)):
        return [obj.__func__]
    if isinstance(obj, types.FunctionType):
        return [obj]
    if inspect.isclass(obj):
        return [f for v in vars(obj).values() for f in _functions(v)]
    return []


def undeclared_uses(patches: List[Patch]) -> Dict[str, List[str]]:
    """Per patch, the names its pasted code reads from an upstream module
    without declaring them in ``uses`` (builtins and names that patch or an
    earlier one adds to that module excepted)."""
    added: Dict[str, set] = {}
    out = {}
    for patch in patches:
        for t in patch.targets:
            added.setdefault(t.owner.partition(":")[0], set()).add(t.attr)
        reads: Dict[str, set] = {}
        for t in patch.targets:
            for fn in _functions(t.new):
                if fn.__module__.partition(".")[0] == "mlx_lm":  # pasted code
                    reads.setdefault(fn.__module__, set()).update(
                        _global_reads(fn.__code__)
                    )
        undeclared = [
            f"{module}.{name}"
            for module, names in sorted(reads.items())
            for name in sorted(names)
            if name not in vars(builtins)
            and name not in added.get(module, ())
            and name not in patch.uses.get(module, ())
        ]
        if undeclared:
            out[patch.name] = undeclared
    return out


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
    fingerprints: Dict[str, Optional[str]],
    removes: Dict[str, str] = {},
):
    """Targets for every attribute defined in ``namespace``'s body.

    ``namespace`` is a plain class written like the upstream class it patches
    (``owner`` is ``"module:Class"``); ``fingerprints`` must name each of its
    attributes, so nothing is replaced without a recorded upstream source.
    ``removes`` maps upstream methods the patch makes dead to their fingerprints.
    Methods are pasted into the owner's module (see ``pasted_into``).
    """
    names = [n for n in vars(namespace) if not n.startswith("__") or n == "__init__"]
    if sorted(names) != sorted(fingerprints):
        raise ValueError(
            f"{namespace.__name__}: fingerprints for {sorted(fingerprints)} "
            f"but it defines {sorted(names)}"
        )
    module = owner.partition(":")[0]
    targets = [
        Target(owner, n, pasted_into(module, vars(namespace)[n]), fingerprints[n])
        for n in names
    ]
    return targets + [Target(owner, n, REMOVED, f) for n, f in removes.items()]


# (owner, attr) -> the upstream object, or _MISSING where upstream had none
_saved: Dict[Tuple[str, str], Any] = {}
_applied: Dict[str, Patch] = {}


def _importers(owner, attr: str, obj) -> List[Any]:
    """Other mlx-lm modules that bound ``obj`` as ``attr`` (``from ... import``)."""
    return [
        mod
        for name, mod in list(sys.modules.items())
        if (name == "mlx_lm" or name.startswith("mlx_lm."))
        and mod is not owner
        and getattr(mod, "__dict__", {}).get(attr) is obj
    ]


def _set(target: Target):
    owner = target.resolve_owner()
    original = (
        owner.__dict__.get(target.attr, _MISSING)
        if inspect.isclass(owner)
        else getattr(owner, target.attr, _MISSING)
    )
    if inspect.ismodule(owner) and original is not _MISSING:
        for mod in _importers(owner, target.attr, original):
            setattr(mod, target.attr, target.new)
    # The first original is kept: two patches never share a target.
    _saved.setdefault(target.key, original)
    if target.new is REMOVED:
        delattr(owner, target.attr)
    else:
        setattr(owner, target.attr, target.new)


def _unset(target: Target):
    original = _saved.pop(target.key)
    owner = target.resolve_owner()
    if inspect.ismodule(owner) and original is not _MISSING:
        # Modules imported while patched bound the replacement too.
        for mod in _importers(owner, target.attr, target.new):
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


def apply_patches(patches: List[Patch], strict: bool = False) -> List[str]:
    """Apply ``patches`` in order; return the names that are applied now."""
    check_disjoint(
        list(_applied.values()) + [p for p in patches if p.name not in _applied]
    )
    for patch in patches:
        if patch.name in _applied:
            continue
        problems = [d for t in patch.targets if (d := t.drift())]
        problems += patch.missing_uses()
        problems += [
            f"needs patch {r!r}, which is not applied"
            for r in patch.requires
            if r not in _applied
        ]
        if problems:
            msg = (
                f"mlx_lm_patched: patch {patch.name!r} not applied "
                f"(written for mlx-lm {UPSTREAM_VERSION}, installed "
                f"{installed_version()}): " + "; ".join(problems)
            )
            if strict:
                raise PatchDriftError(msg)
            warnings.warn(msg, PatchDriftWarning, stacklevel=3)
            continue
        for t in patch.targets:
            _set(t)
        _applied[patch.name] = patch
    return list(_applied)


def dependents(names) -> List[str]:
    """The applied patches that need any of ``names``, directly or not."""
    needed, found = set(names), []
    for patch in _applied.values():  # in apply order: requirements come first
        if patch.name not in needed and needed & set(patch.requires):
            needed.add(patch.name)
            found.append(patch.name)
    return found


def revert_patches(patches: List[Patch]) -> List[str]:
    """Put back the upstream objects, last applied first; patches that need
    a reverted one are reverted with it. Returns the names reverted."""
    names = [p.name for p in patches if p.name in _applied]
    names += dependents(names)
    for name in reversed([n for n in _applied if n in names]):
        for t in reversed(_applied.pop(name).targets):
            _unset(t)
    return names
