"""Modules upstream does not have: a patch's new subsystem is a file of ours
under ``mlx_lm_patched/mlx_lm/`` (``mlx_lm/models/x.py`` is the module
``mlx_lm.models.x``), written as it reads in mlx-lm, relative imports
included, and run as that module while its patch is installed; upstream's
files get only the imports of it (``FromModule``, the hooks). The quilt
series has it as a new file, the vendored wheel as a module of mlx-lm.
"""

import ast
import importlib
import importlib.util
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

from . import _registry  # its Target; it imports this module first
from ._merge import MergeConflict, base_key

ROOT = Path(__file__).parent  # holds mlx_lm/, the new modules' files
_loaded: Dict[str, types.ModuleType] = {}  # name -> the module, run once


@dataclass(frozen=True)
class NewModule:
    """``Target.new`` for a module upstream does not have: our file of it,
    run as the module ``name`` each time it is installed."""

    name: str

    @property
    def path(self) -> Path:
        return ROOT.joinpath(*self.name.split(".")).with_suffix(".py")

    @property
    def file(self) -> str:
        """Its path in mlx-lm's source tree (``mlx_lm/models/x.py``)."""
        return "/".join(self.name.split(".")) + ".py"

    def load(self) -> types.ModuleType:
        """The module, in ``sys.modules`` (where its relative imports and
        upstream's imports of it look) while it is installed; its file run
        once, so its classes stay the same through a revert and apply."""
        if self.name in _loaded:
            sys.modules[self.name] = _loaded[self.name]
            return _loaded[self.name]
        spec = importlib.util.spec_from_file_location(self.name, self.path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[self.name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[self.name]
            raise
        _loaded[self.name] = module
        return module

    def imports(self) -> List[Tuple[str, str]]:
        """``(module, name)`` for each name its top level imports from mlx-lm."""
        package = self.name.rpartition(".")[0]
        out = []
        for node in ast.parse(self.path.read_text()).body:
            if isinstance(node, ast.ImportFrom):
                relative = "." * node.level + (node.module or "")
                module = importlib.util.resolve_name(relative, package)
                if module.partition(".")[0] == "mlx_lm":
                    out += [(module, a.name) for a in node.names]
        return out


@dataclass(frozen=True)
class FromModule:
    """``Target.new`` for a name an upstream file imports from a new module
    (a hook, ``from .x import name``): that module's object once installed."""

    module: str


def defined(module: str, name: str):
    """``name`` as the new module ``module`` defines it, for a patch's class
    body to bind (``_check_state = staticmethod(_check_ring_state)``): the
    module run once (``load``), the new modules it imports first, and left
    out of ``sys.modules`` until installed."""
    needed = [module]
    for m in needed:
        needed += [i for i, _ in NewModule(m).imports() if NewModule(i).path.exists()]
    held = {m: sys.modules.get(m) for m in needed}
    try:
        for m in reversed(needed):
            NewModule(m).load()
        return getattr(sys.modules[module], name)
    finally:
        for m, was in held.items():
            if was is None:
                sys.modules.pop(m, None)
            else:
                sys.modules[m] = was


def new_module(name: str) -> List["_registry.Target"]:
    """The target installing ``NewModule(name)``, an attribute of its package."""
    package, _, attr = name.rpartition(".")
    return [_registry.Target(package, attr, NewModule(name), None)]


def hooks(owner: str, module: str, *names: str) -> List["_registry.Target"]:
    """``from module import *names`` into upstream's ``owner``: the hooks."""
    return [_registry.Target(owner, n, FromModule(module), None) for n in names]


def defines(fn) -> bool:
    """Whether the function ``fn`` is a new module's (``defined``)."""
    if not isinstance(fn, types.FunctionType) or not fn.__module__:
        return False
    return fn.__code__.co_filename == str(NewModule(fn.__module__).path)


def is_new(new) -> bool:
    return isinstance(new, NewModule)


def lazy(new) -> bool:
    """Whether ``new`` is made only when installed (not a helper to keep)."""
    return isinstance(new, (NewModule, FromModule))


def helpers_only(new) -> bool:
    """Whether ``new`` is a new module of functions and values alone, or a
    name imported from one: helpers, kept for the patches that use them where
    their own patch is set aside (``_apply._is_helper``)."""
    name = new.name if isinstance(new, NewModule) else getattr(new, "module", "")
    path = NewModule(name).path
    if not (name and path.exists()):
        return False
    return not any(
        isinstance(n, ast.ClassDef) for n in ast.parse(path.read_text()).body
    )


def materialize(attr: str, new):
    """The object a target installs: a new module run, a hook's name read."""
    if isinstance(new, NewModule):
        return new.load()
    if isinstance(new, FromModule):
        return getattr(sys.modules[new.module], attr)
    return new


def imports(name: str, module: str) -> bool:
    """Whether the new module ``name`` imports ``module``, itself or through
    other new modules."""
    new = NewModule(name)
    if not new.path.exists():
        return False
    found = {m for m, _ in new.imports()}
    return module in found or any(imports(m, module) for m in found - {name})


def added(adds: Dict[str, Set[str]], module: str, name: str) -> Optional[str]:
    """The object (``Target.name``) a patch adds (``adds``: module -> names)
    that ``from module import name`` reads: the module or the name, if new."""
    package, _, attr = module.rpartition(".")
    if attr in adds.get(package, ()):
        return base_key(package, attr)
    if name in adds.get(module, ()):
        return base_key(module, name)
    return None


def needs(adds: Dict[str, Set[str]], new) -> List[str]:
    """The objects of other patches a new module imports."""
    if not isinstance(new, NewModule):
        return []
    return [n for m, name in new.imports() if (n := added(adds, m, name))]


def check(adds: Dict[str, Set[str]], new: NewModule):
    """Raise ``MergeConflict`` where upstream has a module ``new.name`` now,
    or lacks a name of its own that the new module imports."""
    try:
        spec = importlib.util.find_spec(new.name)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin != str(new.path):
        raise MergeConflict(f"{new.name} now exists upstream")
    for module, name in new.imports():
        if added(adds, module, name):
            continue  # another patch's: a need (``needs``)
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError:
            found = False
        if not found:
            raise MergeConflict(
                f"{new.name} imports {name} from {module}, which upstream lacks"
            )
