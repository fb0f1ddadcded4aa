"""The patch registry: owns every upstream object a patch replaces.

A ``Patch`` is a named set of ``Target``s. Each target names an attribute of
an upstream class or module, the object that replaces it, and the source
fingerprint of the upstream object it was written against (``None`` for an
attribute upstream does not have), read from ``bases.json`` (``_merge``).
Where the installed source differs, our change is merged onto it three ways;
a target that cannot be merged says why (``MergeConflict``), and its patch
is set aside (``_apply``). A module upstream does not have is one of ours
(``_newmods``).

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
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import _merge, _newmods
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
    # of other patches its code reads (``_apply.requirements``).
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
    runs exactly as its upstream diff would, and a name the module lacks fails.
    A function of mlx-lm's (a new module's) stays as it is."""
    if isinstance(obj, property):
        fget, fset = (f and pasted_into(module, f) for f in (obj.fget, obj.fset))
        return property(fget, fset, doc=obj.__doc__)
    if isinstance(obj, (classmethod, staticmethod)):
        return type(obj)(pasted_into(module, obj.__func__))
    if not isinstance(obj, types.FunctionType) or obj.__module__.startswith("mlx_lm."):
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


def _importers(owner, attr: str, obj) -> List[Any]:
    """Other mlx-lm modules that bound ``obj`` as ``attr`` (``from ... import``)."""
    return [
        mod
        for name, mod in list(sys.modules.items())
        if (name == "mlx_lm" or name.startswith("mlx_lm."))
        and mod is not owner
        and getattr(mod, "__dict__", {}).get(attr) is obj
    ]


def install(target: Target, new: Any):
    """Put ``new`` at ``target``, a layer on what the patches before left
    there; the upstream object is saved under the first."""
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


def uninstall(target: Target):
    """Take ``target``'s layer off: the one under it comes back, else
    upstream's."""
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
