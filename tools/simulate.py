"""A simulated next mlx-lm release: the installed one, copied, with every
function a patch replaces edited where our change does not touch it, as a
new release edits code (a statement added, a comment added, the docstring
reworded, a local renamed; imports reordered in the files). Each added
statement records that it ran in ``mlx_lm._simulated``. ``conflict`` names
objects edited on a line our change changes too: a real conflict.
"""

import ast
import difflib
import re
import shutil
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

import mlx_lm

from mlx_lm_patched import _merge, _registry

from .source import find_definitions, lines_of

MARK = '__import__("mlx_lm")._simulated.add({!r})'


@dataclass
class Edits:
    """What was edited in one replaced object (its ``Target.name``)."""

    statement: bool = False
    comment: bool = False
    docstring: bool = False
    renamed: Optional[str] = None
    conflict: bool = False
    skipped: str = ""  # why nothing could be added


@dataclass
class Release:
    root: Path  # put it first on sys.path: ``import mlx_lm`` finds it
    edits: Dict[str, Edits] = field(default_factory=dict)
    reordered: List[str] = field(default_factory=list)  # files, imports swapped


def changed_sources(patches: List[_registry.Patch]) -> Dict[str, Tuple[str, int]]:
    """Per upstream object our change rewrites (``Target.name``): its source
    with every patch on it (a replacement, then the edits stacked on it),
    and how many lines either side of a change must stay as they are (the
    context of its edits' hunks; 1 for a three-way merge)."""
    out: Dict[str, Tuple[str, int]] = {}
    for t in (t for p in patches for t in p.targets):
        if isinstance(t.new, _registry.Edit):
            if t.name not in out and t.upstream() is _registry._MISSING:
                continue  # an object an earlier patch adds
            src, margin = out.get(t.name) or (_registry.source_of(t.upstream()), 1)
            src = _merge.apply_hunks(src, t.new.hunks(), t.name)
            runs = re.findall(r"(?m)(?:^(?: .*)?\n)+", t.new.diff)
            out[t.name] = src, max([margin] + [r.count("\n") for r in runs])
        elif (_merge.bases().get(t.name) or {}).get("delta") is not None:
            out[t.name] = _registry.source_of(t.new), 1
    return out


def _touched(base: List[str], ours: List[str], margin: int = 1) -> Set[int]:
    """The base lines our change rewrites or deletes, and the ``margin``
    lines either side of them (0-based)."""
    out: Set[int] = set()
    sm = difflib.SequenceMatcher(None, base, ours, autojunk=False)
    for op, i1, i2, _, _ in sm.get_opcodes():
        if op != "equal":
            out.update(range(max(i1 - margin, 0), i2 + margin))
    return out


def _clear(lines: Iterable[int], touched: Set[int]) -> bool:
    return not any(ln in touched for ln in lines)


def _rename(fn: ast.FunctionDef, touched: Set[int], ours: Set[str]) -> Optional[tuple]:
    """A local of ``fn`` (assigned, not an argument) every use of which is on
    a line clear of our change, and which our lines do not name:
    ``(name, [Name nodes])``."""
    args = {a.arg for a in ast.walk(fn.args) if isinstance(a, ast.arg)}
    nested = [n for n in ast.walk(fn) if n is not fn and isinstance(n, ast.FunctionDef)]
    free = {x.id for n in nested for x in ast.walk(n) if isinstance(x, ast.Name)}
    names: Dict[str, list] = {}
    for n in ast.walk(fn):
        if isinstance(n, ast.Name):
            names.setdefault(n.id, []).append(n)
    for name, uses in names.items():
        stored = any(isinstance(u.ctx, ast.Store) for u in uses)
        if not stored or name in args or name in free or name in ours:
            continue
        if _clear([u.lineno - 1 for u in uses], touched):
            return name, uses
    return None


def _edit(lines: List[str], start: int, base: str, changed, key: str, conflict: bool):
    """Edit ``lines`` (the module) for the definition at ``start`` whose
    base source is ``base`` (``changed``: ours and its margin, see
    ``changed_sources``); return its ``Edits`` and the insertion."""
    ours, margin = changed
    touched = _touched(base.splitlines(True), ours.splitlines(True), margin)
    sm = difflib.SequenceMatcher(
        None, base.splitlines(), ours.splitlines(), autojunk=False
    )
    ours_lines = [
        line
        for op, _, _, j1, j2 in sm.get_opcodes()
        if op != "equal"
        for line in ours.splitlines()[j1:j2]
    ]
    named = set(re.findall(r"[A-Za-z_]\w*", "\n".join(ours_lines)))
    fn = ast.parse(base).body[0]
    edits = Edits()
    indent = lambda row: lines[start + row][
        : len(lines[start + row]) - len(lines[start + row].lstrip())
    ]  # noqa: E731
    if conflict:
        simple = [
            n
            for n in ast.walk(fn)
            if isinstance(n, (ast.Assign, ast.Return, ast.Expr, ast.AugAssign))
            and n.lineno == n.end_lineno
            and n.lineno - 1 in touched
            and n.lineno > 1
        ]
        if simple:
            row = start + simple[0].lineno - 1
            lines[row] = lines[row].rstrip("\n") + "  # upstream changed this line\n"
            edits.conflict = True
        return edits, None
    body = fn.body
    doc = (
        body[0]
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        else None
    )
    if doc is not None and _clear(range(doc.lineno - 1, doc.end_lineno), touched):
        row = start + doc.lineno - 1
        q = lines[row].index(lines[row].lstrip()[:3])
        lines[row] = lines[row][: q + 3] + "(Reworded upstream.) " + lines[row][q + 3 :]
        edits.docstring = True
    found = _rename(fn, touched, named)
    if found:
        name, uses = found
        shift = len(lines[start]) - len(lines[start].lstrip())  # base is dedented
        for u in sorted(uses, key=lambda u: (u.lineno, -u.col_offset)):
            row, a, b = (
                start + u.lineno - 1,
                shift + u.col_offset,
                shift + u.end_col_offset,
            )
            lines[row] = lines[row][:a] + name + "_v2" + lines[row][b:]
        edits.renamed = name
    for stmt in body[1:] if doc is not None else body:
        at = stmt.lineno - 1
        if _clear([at - 1, at], touched):
            pad = indent(at)
            new = [
                f"{pad}# A comment the new release added.\n",
                f"{pad}{MARK.format(key)}\n",
            ]
            edits.statement = edits.comment = True
            return edits, (start + at, new)
    edits.skipped = "no statement of the base is clear of our change"
    return edits, None


def _swap_imports(lines: List[str]) -> bool:
    """Swap the first two adjacent one-line top-level ``import`` statements."""
    tree = ast.parse("".join(lines))
    plain = [
        n for n in tree.body if isinstance(n, ast.Import) and n.lineno == n.end_lineno
    ]
    for a, b in zip(plain, plain[1:]):
        if b.lineno == a.lineno + 1:
            lines[a.lineno - 1], lines[b.lineno - 1] = (
                lines[b.lineno - 1],
                lines[a.lineno - 1],
            )
            return True
    return False


def simulated_release(
    dest: Path, patches: List[_registry.Patch], conflict: Iterable[str] = ()
) -> Release:
    """The installed mlx-lm copied under ``dest`` and edited (see the module)."""
    src = Path(mlx_lm.__file__).parent
    release = Release(Path(dest))
    shutil.copytree(
        src, release.root / "mlx_lm", ignore=shutil.ignore_patterns("__pycache__")
    )
    init = release.root / "mlx_lm" / "__init__.py"
    init.write_text(init.read_text() + "\n_simulated = set()\n")
    conflict = set(conflict)
    ours = changed_sources(patches)
    targets = {t.name: t for p in patches for t in p.targets if t.name in ours}
    by_file: Dict[Path, list] = {}
    for t in targets.values():
        module, _, cls = t.owner.partition(":")
        path = release.root / Path(*module.split(".")).with_suffix(".py")
        by_file.setdefault(path, []).append((t, cls or None))
    for path, items in by_file.items():
        lines = lines_of(path.read_text())
        inserts = []
        for t, cls in items:
            text = "".join(lines)
            defs = find_definitions(text, cls, t.attr)
            if not defs:
                release.edits[t.name] = Edits(skipped="not defined in this file")
                continue
            base = textwrap.dedent(
                "".join("".join(lines[d.start : d.end]) for d in defs)
            )
            edits, insert = _edit(
                lines, defs[0].start, base, ours[t.name], t.name, t.name in conflict
            )
            release.edits[t.name] = edits
            if insert:
                inserts.append(insert)
        for row, new in sorted(inserts, reverse=True):
            lines[row:row] = new
        if _swap_imports(lines):
            release.reordered.append(str(path.relative_to(release.root)))
        path.write_text("".join(lines))
    return release
