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
them. A module upstream does not have is one of ours (``_newmods``).

A target may also be an ``Edit``: a diff of the function as the patches
before it leave it (upstream's, else theirs), applied when it is installed.
Patches stack as quilt's do: patch N edits the result of 1..N-1, and
reverting (or setting aside) one takes the edits stacked on it with it.
"""

import builtins
import importlib
import inspect
import re
import sys
import types
import warnings
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _merge, _newmods, _reads
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
class Edit:
    """``Target.new`` for a change written as what it is: a unified diff of
    the function's dedented source as the patches before leave it, hunks
    with a few lines of context (``_merge.parse_diff``)."""

    diff: str

    def hunks(self) -> List[Tuple[List[str], List[str]]]:
        return _merge.parse_diff(self.diff)

    def reads(self) -> set:
        """The names its added lines use (a superset of the globals)."""
        added = "".join(a for _, after in self.hunks() for a in after)
        return set(re.findall(r"(?<![.\w])[A-Za-z_]\w*", added))


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

    def below(self) -> Any:
        """What an ``Edit`` applies to: the object the patches before it
        installed (a layer under it, where it is installed), else upstream's."""
        layers = [obj for t, obj in _stack.get(self.key, ())]
        mine = [i for i, (t, _) in enumerate(_stack.get(self.key, ())) if t is self]
        layers = layers[: mine[0]] if mine else layers
        return layers[-1] if layers else self.upstream()

    def resolve(self) -> Tuple[Any, str]:
        """``(object to install, how)``: ``new`` as written where upstream has
        the source it was written for, else ours merged onto upstream's
        (``"merged"``). Raises ``MergeConflict`` saying why it cannot."""
        try:
            current = self.upstream()
            if isinstance(self.new, Edit):
                return self._edited(self.below(), current)
        except (ImportError, AttributeError) as e:
            raise MergeConflict(f"{self.owner} is missing ({e})") from None
        where = self.name.replace(":", ".")
        if isinstance(self.new, _newmods.NewModule):
            _newmods.check(_adds, self.new)
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
        return self._compiled(merged, fn.__globals__, fn.__name__), "merged"

    def _compiled(self, source: str, namespace: dict, name: str) -> Any:
        """``source`` compiled in ``namespace`` as the owner's ``name``;
        ``MergeConflict`` where it reads a name upstream no longer binds."""
        owner = self.resolve_owner()
        cls = owner if inspect.isclass(owner) else None
        where = self.name.replace(":", ".")
        new = _merge.compile_merged(source, namespace, cls, name, where)
        gone = _unbound(new, namespace)
        if gone:
            raise MergeConflict(f"{where} uses {gone}, which upstream no longer has")
        return new

    def _edited(self, below: Any, upstream: Any) -> Tuple[Any, str]:
        """The ``Edit`` applied to ``below``'s source, compiled in the owner's
        module: ``"as written"`` where upstream is the release it was written
        for, else ``"merged"``; ``MergeConflict`` where a hunk does not
        apply."""
        where = self.name.replace(":", ".")
        if below is _MISSING:
            raise MergeConflict(f"{where} is missing upstream")
        source = _merge.apply_hunks(source_of(below), self.new.hunks(), where)
        module = vars(importlib.import_module(self.owner.partition(":")[0]))
        new = self._compiled(source, module, self.attr)
        same = upstream is _MISSING or fingerprint(upstream) == self.fingerprint
        return new, "as written" if same else "merged"

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


def edits(owner: str, **diffs: str) -> List[Target]:
    """Targets changing functions of ``owner`` (a module or a class, as for
    ``targets``) by diffs of their source (``Edit``), each under its name:
    ``edits("mlx_lm.server:ResponseGenerator", _generate=GENERATE)``."""
    return [Target(owner, attr, Edit(diff)) for attr, diff in diffs.items()]


# module -> the names patches add to it (upstream has none)
_adds: Dict[str, set] = {}
_modules: set = set()  # the upstream modules patches change
# attribute -> the targets (``Target.name``) that add it to an upstream class
_fields: Dict[str, set] = {}
# (owner, attr) -> the upstream object, or _MISSING where upstream had none
_saved: Dict[Tuple[str, str], Any] = {}
# (owner, attr) -> the object installed there (ours, or ours merged)
_installed: Dict[Tuple[str, str], Any] = {}
# (owner, attr) -> the targets installed there and their objects, bottom first
# (a replacement or an edit of upstream's, then the edits stacked on it)
_stack: Dict[Tuple[str, str], List[Tuple[Target, Any]]] = {}
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
    if any(t is target for t, _ in _stack.get(target.key, ())):
        return
    new = _newmods.materialize(target.attr, new)
    owner = target.resolve_owner()
    original = (
        owner.__dict__.get(target.attr, _MISSING)
        if inspect.isclass(owner)
        else getattr(owner, target.attr, _MISSING)
    )
    if inspect.ismodule(owner) and original is not _MISSING:
        for mod in _importers(owner, target.attr, original):
            setattr(mod, target.attr, new)
    # The first original is kept: later patches only stack edits on it.
    _saved.setdefault(target.key, original)
    _installed[target.key] = new
    _stack.setdefault(target.key, []).append((target, new))
    if new is REMOVED:
        delattr(owner, target.attr)
    else:
        setattr(owner, target.attr, new)


def _unset(target: Target):
    layers = _stack[target.key]
    new = layers.pop()[1]  # reverted last applied first: the top one
    if layers:  # the layer under it comes back
        original = _installed[target.key] = layers[-1][1]
    else:
        del _stack[target.key], _installed[target.key]
        original = _saved.pop(target.key)
    owner = target.resolve_owner()
    if inspect.ismodule(owner) and original is not _MISSING:
        # Modules imported while patched bound the replacement too.
        for mod in _importers(owner, target.attr, new):
            setattr(mod, target.attr, original)
    if original is _MISSING:
        delattr(owner, target.attr)
    else:
        setattr(owner, target.attr, original)
    if isinstance(target.new, _newmods.NewModule):
        sys.modules.pop(target.new.name, None)


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
    attribute) that only a later patch provides (``_reads.check_order``)."""
    _reads.check_order(
        patches, lambda p: _needs(p.targets) + sorted(_attribute_needs(p.targets))
    )


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
    out = set()
    for t in targets:
        if isinstance(t.new, Edit):
            module = t.owner.partition(":")[0]
            reads = _adds.get(module, set()) & t.new.reads()
            out.update(_merge.base_key(module, n) for n in reads)
        for fn in functions(t.new):
            module = fn.__globals__.get("__name__")
            added = _adds.get(module, set()) & _names(fn.__code__)
            out.update(
                _merge.base_key(module, n) for n in added & _global_reads(fn.__code__)
            )
        out.update(_newmods.needs(_adds, t.new))
    return sorted(out - {t.name for t in targets})


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
                    if t.key not in _installed:
                        _set(t, resolved[t.key][0])
                _patches[patch.name] = helpers
                msg += f" (its helpers {[t.attr for t in helpers]} stay installed)"
            warnings.warn(msg, PatchDriftWarning, stacklevel=3)
            continue
        for t in patch.targets:
            _set(t, resolved[t.key][0])
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
        layers = [s for s, _ in _stack.get(t.key, ())]
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
            _unset(t)
        _applied.pop(name, None)
        _merged.pop(name, None)
    return names
