"""A patch's upstream-style tests, written into upstream's test files.

``upstream_tests/<patch name>.py`` (optional) holds, per upstream test file
(a path in the sdist, ``tests/test_prompt_cache.py``):

- ``ADD``: ``{file: [classes]}``; a class named like one the file defines
  gives its methods, appended to that class; any other class is added whole,
  before ``if __name__ == "__main__":``;
- ``EDIT``: ``{file: [(old, new), ...]}``: exact replacements, each ``old``
  found once (imports, assertions on internals the patch changes).

The methods are written as they read in upstream's file, and run there:
they use that file's imports (an ``EDIT`` adds what they lack).
"""

import importlib.util
import inspect
import re
from pathlib import Path
from types import ModuleType
from typing import Dict, List, Optional

from mlx_lm_patched._registry import Patch

from .rewrite import GenerateError, check_compiles, read_file, reindent, source_block
from .source import find_class, lines_of, span

MAIN = re.compile(r'^if __name__ == "__main__":', re.M)


def tests_of(patch: Patch) -> Optional[ModuleType]:
    """``tools.upstream_tests.<patch.name>``, if there is one."""
    name = f"{__package__}.upstream_tests.{patch.name}"
    if importlib.util.find_spec(name) is None:
        return None
    return importlib.import_module(name)


def _methods(cls: type) -> List:
    return [f for f in vars(cls).values() if inspect.isfunction(f)]


def _block(obj, indent: str) -> List[str]:
    start, end, lines = source_block(obj)
    old = re.match(r"[ \t]*", lines[start]).group(0)
    return reindent(lines[start:end], old, indent)


def _add_class(text: str, cls: type) -> str:
    lines = lines_of(text)
    node = find_class(text, cls.__name__)
    if node is None:
        new = _block(cls, "")
        m = MAIN.search(text)
        if m is None:
            return text.rstrip("\n") + "\n\n\n" + "".join(new)
        at = text[: m.start()].count("\n")
        lines[at:at] = new + ["\n", "\n"]
        return "".join(lines)
    indent = " " * node.body[0].col_offset
    new = []
    for f in _methods(cls):
        new += ["\n"] + _block(f, indent)
    at = span(lines, node.body[-1])[1]
    lines[at:at] = new
    return "".join(lines)


def _edit(text: str, old: str, new: str, where: str) -> str:
    n = text.count(old)
    if n != 1:
        raise GenerateError(f"{where}: {old!r} found {n} times, not once")
    return text.replace(old, new)


def apply_test_edits(files: Dict[str, str], patch: Patch, tree: Path) -> Dict[str, str]:
    """``files`` with ``patch``'s test edits and tests written in (any test
    file missing is read from ``tree``)."""
    mod = tests_of(patch)
    if mod is None:
        return files
    out = dict(files)
    who = f"patch {patch.name!r} (upstream_tests/{patch.name}.py)"
    for rel, pairs in getattr(mod, "EDIT", {}).items():
        read_file(out, rel, tree, who)
        for old, new in pairs:
            out[rel] = _edit(out[rel], old, new, f"{who} {rel}")
    for rel, classes in getattr(mod, "ADD", {}).items():
        read_file(out, rel, tree, who)
        for cls in classes:
            out[rel] = _add_class(out[rel], cls)
    check_compiles(out, who)
    return out


def added_tests(patch: Patch) -> List[str]:
    """Node ids (relative to ``tests/``) of the tests ``patch`` adds."""
    mod = tests_of(patch)
    found = []
    for rel, classes in getattr(mod, "ADD", {}).items() if mod else ():
        for cls in classes:
            for f in _methods(cls):
                if f.__name__.startswith("test"):
                    found.append(f"{Path(rel).name}::{cls.__name__}::{f.__name__}")
    return found
