"""Writing a patch into upstream's source: each ``Target`` of a ``Patch``
rewritten in the text of the file its owner lives in.

A replaced attribute's definition (decorators, property getter and setter
included) gives way to the replacement's source; a new method goes next to
its neighbours in the patch's namespace class; an edited one gets its
diff's hunks, applied to the file's text as at run time; a new module-level object
goes before the first definition that uses it (a module target is an
``import`` among the first block of imports; a function pasted into another
upstream module is a name added to the file's ``from`` import of it; any
other value is its assignment in the patch's file); a removed one goes.
"""

import ast
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from mlx_lm_patched import _merge, _newmods
from mlx_lm_patched._registry import (
    REMOVED,
    Edit,
    Patch,
    Target,
    fingerprint_source,
    source_of,
)

from .sdist import module_file
from .source import (
    NotFound,
    assigns,
    find_class,
    find_definitions,
    lines_of,
    parse,
    source_from_text,
    span,
    start_of,
)


class GenerateError(RuntimeError):
    """A patch cannot be written as a diff of upstream's source."""


# -- replacement source from the live objects ---------------------------------


def functions_of(new) -> List:
    """The functions (or class) whose source makes up ``new``."""
    if isinstance(new, property):
        return [f for f in (new.fget, new.fset, new.fdel) if f is not None]
    if isinstance(new, (staticmethod, classmethod)):
        return [new.__func__]
    if inspect.isfunction(new) or inspect.isclass(new):
        return [new]
    return []


def _assignment_lines(attr: str, cls: Optional[str], origin) -> Optional[List[str]]:
    """The statement assigning ``attr`` at the top of the file ``origin`` (in
    its class named like ``cls``, for a class attribute), or of the module
    beside it that ``origin`` imports ``attr`` from, if there is one."""
    if not origin or not Path(origin).exists():
        return None
    text = Path(origin).read_text()
    body = parse(text).body
    if cls is not None:  # written as the class, or as ``_Class`` (a class patch)
        name = cls.split(".")[-1]
        node = find_class(text, name) or find_class(text, "_" + name)
        body = node.body if node is not None else []
    lines = lines_of(text)
    for stmt in body:
        if assigns(stmt, attr):
            start, end = span(lines, stmt)
            return lines[start:end]
    if cls is None:  # a value the patch's file imports from a module beside it
        for stmt in body:
            if isinstance(stmt, ast.ImportFrom) and stmt.level == 1 and stmt.module:
                if any(a.name == attr and a.asname is None for a in stmt.names):
                    beside = Path(origin).parent / (stmt.module + ".py")
                    return _assignment_lines(attr, None, beside)
    return None


def replacement_lines(
    new, attr: str, indent: str, origin=None, cls: Optional[str] = None
) -> List[str]:
    """The source of ``new`` re-indented to ``indent``, as written in its
    module (a property's getter, setter and the blank lines between); a new
    module's function a class binds, the binding in ``origin``. A module is
    an ``import``; any other value is its assignment in ``origin``
    (the patch's file), else its ``repr`` if that reads back equal."""
    if isinstance(new, types.ModuleType):
        line = f"import {new.__name__}"
        return [indent + line + ("\n" if attr == new.__name__ else f" as {attr}\n")]
    funcs = functions_of(new)
    if not funcs:
        found = _assignment_lines(attr, cls, origin)
        if found:
            return reindent(found, re.match(r"[ \t]*", found[0]).group(0), indent)
        text = f"{attr} = {new!r}\n"
        try:
            same = ast.literal_eval(repr(new)) == new
        except (ValueError, SyntaxError):
            same = False
        if not same:
            raise GenerateError(f"{attr}: cannot write {type(new).__name__} as source")
        return [indent + text]
    if cls is not None and all(_newmods.defines(f) for f in funcs):
        found = _assignment_lines(attr, cls, origin)  # the class's binding
        if found:
            return reindent(found, re.match(r"[ \t]*", found[0]).group(0), indent)
    blocks = sorted(source_block(f) for f in funcs)
    out: List[str] = []
    for i, (s, e, file_lines) in enumerate(blocks):
        if i:
            gap = file_lines[blocks[i - 1][1] : s]
            out += gap if gap and all(not g.strip() for g in gap) else ["\n"]
        out += file_lines[s:e]
    return reindent(out, re.match(r"[ \t]*", out[0]).group(0), indent)


def source_file(obj) -> Optional[str]:
    """The file ``obj`` was written in. A class's own functions say it even
    when its ``__module__`` names another module (a class meant to look
    native to ``mlx_lm.models.cache``), where ``inspect`` would look."""
    if inspect.isclass(obj):
        for value in vars(obj).values():
            for f in functions_of(value):
                if inspect.isfunction(f):
                    return f.__code__.co_filename
    try:
        return inspect.getsourcefile(obj)
    except TypeError:
        return None


def source_block(obj) -> Tuple[int, int, List[str]]:
    """``(start, end, lines)``: ``obj``'s lines ``[start, end)`` of its file."""
    if inspect.isclass(obj):
        file = source_file(obj)
        text = Path(file).read_text() if file else ""
        node = find_class(text, obj.__qualname__) if text else None
        if node is None:
            raise GenerateError(f"no source for class {obj.__qualname__}")
        lines = lines_of(text)
        return (*span(lines, node), lines)
    block, lnum = inspect.getsourcelines(obj)
    return lnum - 1, lnum - 1 + len(block), inspect.findsource(obj)[0]


def _string_rows(lines: List[str]) -> set:
    """1-based rows that start inside a multi-line string (left untouched)."""
    rows = set()
    toks = tokenize.generate_tokens(io.StringIO("".join(lines)).readline)
    for tok in toks:
        if tok.start[0] < tok.end[0] and tok.type not in (
            tokenize.NL,
            tokenize.NEWLINE,
        ):
            rows.update(range(tok.start[0] + 1, tok.end[0] + 1))
    return rows


def reindent(lines: List[str], old: str, new: str) -> List[str]:
    """``lines`` indented by ``new`` instead of ``old`` (multi-line strings
    left as they are)."""
    if old == new:
        return list(lines)
    inside = _string_rows(lines)
    out = []
    for row, line in enumerate(lines, 1):
        if row in inside or not line.strip():
            out.append(line if row in inside else "\n")
        elif line.startswith(old):
            out.append(new + line[len(old) :])
        else:
            out.append(line)
    return out


# -- rewriting upstream's source, one patch at a time -------------------------


def split_owner(owner: str) -> Tuple[str, Optional[str]]:
    module, _, cls = owner.partition(":")
    return module, (cls or None)


def body_indent(text: str, cls: str) -> str:
    return " " * find_class(text, cls).body[0].col_offset


def attached_comments(lines: List[str], start: int) -> int:
    """Move ``start`` up over comment lines directly above it."""
    indent = re.match(r"[ \t]*", lines[start]).group(0)
    while start > 0 and lines[start - 1].startswith(indent + "#"):
        start -= 1
    return start


def is_removal(t: Target) -> bool:
    return t.new is REMOVED


def is_edit(t: Target) -> bool:
    return isinstance(t.new, Edit)


def _edit(lines: List[str], defs, t: Target) -> None:
    """``t``'s diff applied to its definition in ``lines``, as ``_registry``
    applies it to the function's dedented source."""
    start, end = min(d.start for d in defs), max(d.end for d in defs)
    source = textwrap.dedent("".join(lines[start:end]))
    indent = lines[start][: len(lines[start]) - len(lines_of(source)[0])]
    try:
        edited = _merge.apply_hunks(source, t.new.hunks(), t.name)
    except _merge.MergeConflict as e:
        raise GenerateError(f"conflict in {e}") from None
    lines[start:end] = lines_of(textwrap.indent(edited, indent))


def _remove(lines: List[str], defs, cls: Optional[str]) -> None:
    gap = 1 if cls else 2  # blank lines between definitions
    for d in sorted(defs, key=lambda d: -d.start):
        start, end = attached_comments(lines, d.start), d.end
        for _ in range(gap):
            if end < len(lines) and not lines[end].strip():
                end += 1
            elif start > 0 and not lines[start - 1].strip():
                start -= 1
        del lines[start:end]


def _merged_source(text: str, t: Target, cls: Optional[str]) -> Optional[str]:
    """Where ``text`` defines ``t``'s upstream object with other source than
    the patch was written for: ours merged onto it (``_merge``), or a
    ``GenerateError`` naming the conflict. ``None`` where it is the same."""
    theirs = source_from_text(text, cls, t.attr)[0]
    if t.fingerprint is None or theirs is None or is_edit(t):
        return None
    if fingerprint_source(theirs) == t.fingerprint:
        return None
    edits = _merge.bases().get(t.name, {}).get("delta")
    if is_removal(t) or edits is None:
        raise GenerateError(f"{t.name}: changed upstream, which the patch removes")
    ours = source_of(t.new)
    base = "".join(_merge.rebuild(lines_of(ours), edits))
    try:
        return _merge.merge(base, ours, theirs, t.name)
    except _merge.MergeConflict as e:
        raise GenerateError(f"conflict in {e}") from None


def _rewrite_target(text: str, t: Target, siblings: List[Target], origin=None) -> str:
    """``text`` with target ``t`` replaced, inserted or removed."""
    _, cls = split_owner(t.owner)
    lines = lines_of(text)
    defs = find_definitions(text, cls, t.attr)
    if is_removal(t):
        if not defs:
            raise GenerateError(
                f"{t.owner}.{t.attr}: to be removed, but not defined upstream"
            )
        _merged_source(text, t, cls)
        _remove(lines, defs, cls)
        return "".join(lines)
    if is_edit(t):
        if not defs:
            raise GenerateError(f"{t.name}: to be edited, but not defined there")
        _edit(lines, defs, t)
        return "".join(lines)
    indent = body_indent(text, cls) if cls else ""
    merged = _merged_source(text, t, cls) if defs else None
    if merged is not None:
        new = reindent(lines_of(merged), "", indent)
    else:
        new = replacement_lines(t.new, t.attr, indent, origin, cls)
    if defs:
        first = min(d.start for d in defs)
        for d in sorted(defs, key=lambda d: -d.start):
            end = d.end
            if d.start != first and end < len(lines) and not lines[end].strip():
                end += 1
            lines[d.start : end] = new if d.start == first else []
        return "".join(lines)
    if cls is None:
        return text  # new module-level objects are placed by _place_module_level
    # A new attribute goes where the namespace class has it: after the nearest
    # earlier sibling that the class defines, else before the nearest later one.
    i = next(k for k, s in enumerate(siblings) if s is t)
    for s in reversed(siblings[:i]):
        found = find_definitions(text, cls, s.attr)
        if found:
            at = max(d.end for d in found)
            lines[at:at] = ["\n"] + new
            return "".join(lines)
    for s in siblings[i + 1 :]:
        found = find_definitions(text, cls, s.attr)
        if found:
            at = attached_comments(lines, min(d.start for d in found))
            lines[at:at] = new + ["\n"]
            return "".join(lines)
    at = span(lines, find_class(text, cls).body[-1])[1]
    lines[at:at] = ["\n"] + new
    return "".join(lines)


_IMPORTS = (ast.Import, ast.ImportFrom)


def _import_line(text: str, name: str) -> int:
    """Where ``import name`` goes, isort-style: among the plain imports of the
    first block of imports (stdlib, in upstream's files), in name order."""
    body = parse(text).body
    first_def = next(
        (i for i, n in enumerate(body) if not isinstance(n, _IMPORTS + (ast.Expr,))),
        len(body),
    )
    group: List[ast.stmt] = []
    for node in body[:first_def]:
        if not isinstance(node, _IMPORTS):
            continue
        if group and node.lineno > group[-1].end_lineno + 1:
            break  # a blank line ends the first block
        group.append(node)
    if not group:
        return 0
    for node in group:
        if isinstance(node, ast.ImportFrom) or node.names[0].name > name:
            return node.lineno - 1
    return group[-1].end_lineno


def _imports(text: str, name: str) -> bool:
    """Whether the module binds ``name`` with an import statement."""
    return any(
        (alias.asname or alias.name.split(".")[0]) == name
        for node in parse(text).body
        if isinstance(node, _IMPORTS)
        for alias in node.names
    )


def _reads(node: ast.AST, name: str) -> bool:
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(node))


def imported_from(t: Target) -> Optional[str]:
    """The module ``t``'s function is pasted into, where that is another
    module of ``t``'s package, or the new module a hook names: ``t`` is
    imported from there."""
    if isinstance(t.new, _newmods.FromModule):
        return t.new.module
    own = split_owner(t.owner)[0]
    home = t.new.__module__ if inspect.isfunction(t.new) else own
    same_package = home.partition(".")[0] == own.partition(".")[0]
    return home if same_package and home != own else None


def _relative(own: str, home: str) -> Tuple[int, str]:
    """``(level, module)`` of ``from <home> import`` written in ``own``."""
    package, parts = own.split(".")[:-1], home.split(".")
    common = 0
    while common < min(len(package), len(parts)) and package[common] == parts[common]:
        common += 1
    return len(package) - common + 1, ".".join(parts[common:])


def _new_import_line(text: str, level: int, module: str) -> int:
    """Where a new relative ``from`` import goes, isort-style: among the
    file's relative imports (``..`` first, then by name), else after its
    last import, a blank line between."""
    nodes = [n for n in parse(text).body if isinstance(n, _IMPORTS)]
    relative = [n for n in nodes if isinstance(n, ast.ImportFrom) and n.level]
    for n in relative:
        if (-n.level, n.module or "") > (-level, module):
            return n.lineno - 1
    return (relative or nodes)[-1].end_lineno


def _names_key(name: str) -> Tuple[int, str]:
    """isort's order of the names of a ``from`` import: constants, classes,
    then the rest, each without regard to case."""
    kind = 0 if name.isupper() and len(name) > 1 else 1 if name[:1].isupper() else 2
    return kind, name.lower()


def _add_import(text: str, own: str, home: str, name: str, new=False) -> str:
    """``text`` (module ``own``) with ``name`` added to its relative ``from``
    import of module ``home`` (with ``new``, a new one where it has none:
    a hook's; last in the file where ``home`` imports ``own``, so either
    imports first), written as black and isort write it."""
    level, relative = _relative(own, home)
    found = [
        n
        for n in parse(text).body
        if isinstance(n, ast.ImportFrom)
        and n.level == level
        and (n.module or "") == relative
    ]
    if not found and not new:
        raise GenerateError(f"{own} has no 'from .{relative} import' to add {name} to")
    lines = lines_of(text)
    if found:
        node = found[0]
        names = [a.name + (f" as {a.asname}" if a.asname else "") for a in node.names]
        start, end = node.lineno - 1, node.end_lineno
    elif _newmods.imports(home, own):
        names, start = [], len(lines) + 2
        end = start
        lines += ["\n", "\n"]
    else:
        names, start = [], _new_import_line(text, level, relative)
        end = start
        if not any(isinstance(n, ast.ImportFrom) and n.level for n in parse(text).body):
            lines[start:start] = ["\n"]
            start = end = start + 1
    names = sorted(names + [name], key=_names_key)
    head = f"from {'.' * level}{relative} import "
    statement = [head + ", ".join(names) + "\n"]
    if end - start > 1 or len(statement[0]) > 89:  # 88 and its newline
        statement = [head + "(\n"] + [f"    {n},\n" for n in names] + [")\n"]
    lines[start:end] = statement
    return "".join(lines)


def _place_module_level(text: str, t: Target, origin=None) -> str:
    """Insert a new module-level object before the first statement using it
    (an import after the imports at the top, or in the ``from`` import of the
    module it comes from)."""
    if find_definitions(text, None, t.attr) or _imports(text, t.attr):
        return text
    home = imported_from(t)
    if home:
        hook = isinstance(t.new, _newmods.FromModule)
        return _add_import(text, split_owner(t.owner)[0], home, t.attr, hook)
    lines = lines_of(text)
    new = replacement_lines(t.new, t.attr, "", origin)
    if isinstance(t.new, types.ModuleType):
        at = _import_line(text, t.new.__name__)
        lines[at:at] = new
        return "".join(lines)
    nodes = parse(text).body
    # A new class goes after its bases: a method body that names it runs later.
    bases = {b.__name__ for b in getattr(t.new, "__bases__", ())}
    ends = [n.end_lineno for n in nodes if getattr(n, "name", None) in bases]
    if ends:
        lines[max(ends) : max(ends)] = ["\n", "\n"] + new
        return "".join(lines)
    for node in nodes:
        if not isinstance(node, _IMPORTS) and _reads(node, t.attr):
            at = attached_comments(lines, start_of(node))
            lines[at:at] = new + ["\n", "\n"]
            return "".join(lines)
    if lines and not lines[-1].endswith("\n"):
        lines[-1] += "\n"
    return "".join(lines + ["\n", "\n"] + new)


def patch_module(patch: Patch):
    """The module that defines ``patch`` (``PATCH``), or else the one its
    functions were written in (``_registry.pasted_into`` gives a function its
    owner's module; its code still says which file it was written in)."""
    for mod in list(sys.modules.values()):
        if getattr(mod, "PATCH", None) is patch:
            return mod
    files = {source_file(f) for t in patch.targets for f in functions_of(t.new)}
    for mod in list(sys.modules.values()):
        if getattr(mod, "__file__", None) in files:
            return mod
    return None


def read_file(files: Dict[str, str], rel: str, tree: Path, who: str) -> str:
    """``files[rel]``, read from ``tree`` the first time."""
    if rel not in files:
        path = tree / rel
        if not path.exists():
            raise GenerateError(f"{who}: {rel} is not in the sdist")
        files[rel] = path.read_text()
    return files[rel]


def check_compiles(files: Dict[str, str], who: str) -> None:
    for rel, text in files.items():
        try:
            compile(text, rel, "exec")
        except SyntaxError as e:
            raise GenerateError(f"{who}: {rel} no longer parses: {e}") from None


def apply_to_sources(files: Dict[str, str], patch: Patch, tree: Path) -> Dict[str, str]:
    """The files a patch's targets touch, rewritten; ``files`` holds earlier
    patches' output (anything missing is read from ``tree``)."""
    out = dict(files)
    origin = getattr(patch_module(patch), "__file__", None)
    who = f"patch {patch.name!r}"
    for t in patch.targets:
        if isinstance(t.new, _newmods.NewModule):
            out[t.new.file] = t.new.path.read_text()  # a new file, as written
            continue
        rel = module_file(split_owner(t.owner)[0], tree)
        read_file(out, rel, tree, who)
        if isinstance(t.new, _newmods.FromModule):
            continue  # an import: below
        siblings = [
            s for s in patch.targets if s.owner == t.owner and not is_removal(s)
        ]
        try:
            out[rel] = _rewrite_target(out[rel], t, siblings, origin)
        except (GenerateError, NotFound) as e:
            raise GenerateError(f"{who}: {e}") from None
    # Last first, so an object an earlier one is used by is already in place.
    for t in reversed(patch.targets):
        module, cls = split_owner(t.owner)
        if cls is None and not is_removal(t) and not _newmods.is_new(t.new):
            rel = module_file(module, tree)
            out[rel] = _place_module_level(out[rel], t, origin)
    check_compiles(out, who)
    return out
