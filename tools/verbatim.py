"""How much of upstream the patches carry verbatim: per upstream object a
patch changes, the lines of its upstream source the package holds
unchanged (a replacement's lines equal to upstream's; an edit's context
lines, the ones its hunks find and leave), against the object's lines.
``check-patches`` prints the total; a patch should carry a change, not a
copy."""

import difflib
from dataclasses import dataclass
from typing import Dict, List, Sequence

from mlx_lm_patched import _registry
from mlx_lm_patched._registry import REMOVED, Edit, Patch


@dataclass
class Carried:
    name: str  # Target.name
    patches: List[str]
    lines: int  # of upstream's source
    verbatim: int  # of those, carried unchanged by the package


def _equal_lines(upstream: List[str], ours: List[str]) -> int:
    sm = difflib.SequenceMatcher(None, upstream, ours, autojunk=False)
    return sum(size for _, _, size in sm.get_matching_blocks())


def _context_lines(edit: Edit) -> int:
    return sum(line[:1] == " " or not line.strip() for line in _hunk_lines(edit))


def _hunk_lines(edit: Edit) -> List[str]:
    return [ln for ln in edit.diff.splitlines(True) if not ln.startswith("@@")]


def carried(patches: Sequence[Patch]) -> List[Carried]:
    """One row per upstream object the patches replace or edit."""
    rows: Dict[str, Carried] = {}
    for patch in patches:
        for t in patch.targets:
            if t.new is REMOVED or t.fingerprint is None:
                continue
            upstream = t.upstream()
            if upstream is _registry._MISSING:
                continue
            lines = _registry.source_of(upstream).splitlines(True)
            row = rows.setdefault(t.name, Carried(t.name, [], len(lines), 0))
            row.patches.append(patch.name)
            if isinstance(t.new, Edit):
                row.verbatim += _context_lines(t.new)
            elif _registry.functions(t.new) or isinstance(t.new, property):
                ours = _registry.source_of(t.new).splitlines(True)
                row.verbatim += _equal_lines(lines, ours)
            row.verbatim = min(row.verbatim, row.lines)
    return list(rows.values())


def summary(rows: Sequence[Carried]) -> str:
    lines = sum(r.lines for r in rows)
    verbatim = sum(r.verbatim for r in rows)
    share = verbatim / lines if lines else 0.0
    return (
        f"verbatim: {verbatim} of {lines} lines of the {len(rows)} upstream "
        f"objects the patches change ({share:.0%})"
    )


def report(rows: Sequence[Carried], top: int = 10) -> str:
    """``summary`` and the objects carrying the most verbatim lines."""
    out = [summary(rows)]
    for r in sorted(rows, key=lambda r: -r.verbatim)[:top]:
        out.append(
            f"  {r.verbatim:4} of {r.lines:4}  {r.name} ({', '.join(r.patches)})"
        )
    return "\n".join(out)
