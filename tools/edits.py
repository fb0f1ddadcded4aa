"""Writing a change to an upstream function as an ``Edit``: the unified
diff of its source, before and after, in the form ``_registry.Edit`` takes
(hunks with ``context`` lines around each change, more where the lines a
hunk finds occur twice). ``python -m tools edit OBJECT`` prints the diff
between upstream's source of ``OBJECT`` and what the patches install there.
"""

import difflib
from typing import List

from mlx_lm_patched import _merge, _registry


def diff_of(before: str, after: str, context: int = 3) -> str:
    """The hunks turning ``before`` into ``after``, each finding its lines
    once in ``before`` (``_merge.apply_hunks``)."""
    a, b = before.splitlines(True), after.splitlines(True)
    groups = difflib.SequenceMatcher(None, a, b, autojunk=False).get_grouped_opcodes(
        context
    )
    out: List[str] = []
    for group in groups:
        (_, i1, _, j1, _), (_, _, i2, _, j2) = group[0], group[-1]
        while i1 > 0 and _count(a, a[i1:i2]) > 1:  # widen until found once
            i1, i2, j1, j2 = i1 - 1, i2 + 1, j1 - 1, j2 + 1
        out.append(f"@@ -{i1 + 1},{i2 - i1} +{j1 + 1},{j2 - j1} @@\n")
        sm = difflib.SequenceMatcher(None, a[i1:i2], b[j1:j2], autojunk=False)
        for op, x1, x2, y1, y2 in sm.get_opcodes():
            if op == "equal":
                out += [" " + line for line in a[i1 + x1 : i1 + x2]]
                continue
            out += ["-" + line for line in a[i1 + x1 : i1 + x2]]
            out += ["+" + line for line in b[j1 + y1 : j1 + y2]]
    text = "".join(out)
    if _merge.apply_hunks(before, _merge.parse_diff(text), "diff_of") != after:
        raise AssertionError("diff_of: the hunks do not rebuild the source")
    return text


def _count(lines: List[str], block: List[str]) -> int:
    n = len(block)
    return sum(lines[k : k + n] == block for k in range(len(lines) - n + 1))


def installed_diff(name: str) -> str:
    """``diff_of`` upstream's source of ``name`` (``Target.name``) and what
    the applied patches install there."""
    key = next(k for k in _registry._installed if _merge.base_key(*k) == name)
    target = _registry.Target(*key, None, None)
    before = _registry.source_of(target.upstream())
    return diff_of(before, _registry.source_of(_registry._installed[key]))
