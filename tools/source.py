"""Reading definitions and names out of Python source text.

Everything here works on text (upstream's files as the sdist has them, or
as earlier patches left them), never on imported modules, so a release can
be checked without installing it.
"""

import ast
import builtins
import functools
import inspect
import re
import symtable
import textwrap
from dataclasses import dataclass
from typing import List, Optional, Set, Tuple

_BUILTINS = set(dir(builtins)) | {"__file__", "__name__", "__spec__"}


def lines_of(text: str) -> List[str]:
    return text.splitlines(keepends=True)


@functools.lru_cache(maxsize=16)
def parse(text: str) -> ast.Module:
    """``ast.parse``, cached: the trees are only read."""
    return ast.parse(text)


def start_of(node: ast.stmt) -> int:
    """0-based first line of a statement, decorators included."""
    lines = [node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]
    return min(lines) - 1


def span(lines: List[str], node: ast.stmt) -> Tuple[int, int]:
    """0-based [start, end) lines of a definition, as ``inspect.getsource``
    cuts it (``inspect.getblock`` from its first decorator)."""
    start = start_of(node)
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


def assigns(node: ast.stmt, attr: str) -> bool:
    """Whether ``node`` is an assignment to the name ``attr``."""
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
    lines = lines_of(text)
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
        return _class_node(parse(text), qualname)
    ast.increment_lineno(module, start)
    return _class_node(module, qualname)


class NotFound(LookupError):
    """A class the source text was expected to define is not there."""


@dataclass
class Definition:
    kind: str  # "plain" | "getter" | "setter" | "deleter" | "value"
    start: int
    end: int


def find_definitions(text: str, cls: Optional[str], attr: str) -> List[Definition]:
    """Where ``attr`` is defined in class ``cls`` (or the module body)."""
    if cls is None:
        body = parse(text).body
    else:
        node = find_class(text, cls)
        if node is None:
            raise NotFound(f"class {cls} not found")
        body = node.body
    lines, found = lines_of(text), []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name == attr:
                found.append(
                    Definition(_decorator_kind(node, attr), *span(lines, node))
                )
        elif assigns(node, attr):
            found.append(Definition("value", *span(lines, node)))
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
    lines = lines_of(text)
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


# -- names ----------------------------------------------------------------------


def _bound_and_read(top: symtable.SymbolTable) -> Tuple[Set[str], Set[str]]:
    """``(bound, read)``: names ``top`` binds, and the global names read
    anywhere in it or in the scopes nested in it."""
    symbols = top.get_symbols()
    bound = {
        s.get_name()
        for s in symbols
        if s.is_assigned() or s.is_imported() or s.is_namespace()
    }
    read = {s.get_name() for s in symbols if s.is_referenced()}

    def walk(table):
        for s in table.get_symbols():
            if s.is_referenced() and (s.is_global() or s.is_declared_global()):
                read.add(s.get_name())
        for child in table.get_children():
            walk(child)

    for child in top.get_children():
        walk(child)
    return bound, read


def undefined_names(text: str, filename: str) -> Set[str]:
    """Global names the module's code reads but never binds."""
    bound, read = _bound_and_read(symtable.symtable(text, filename, "exec"))
    return read - bound - _BUILTINS


def free_names(source: str) -> Set[str]:
    """Global names a definition (or statement) reads that it does not bind
    itself nor finds among the builtins: what it takes from the module it is
    pasted into."""
    return undefined_names(textwrap.dedent(source), "<pasted>")


def module_names(text: str) -> Set[str]:
    """Names the module body binds: definitions, assignments, imports."""
    bound, _ = _bound_and_read(symtable.symtable(text, "<module>", "exec"))
    return bound
