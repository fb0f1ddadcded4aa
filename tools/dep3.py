"""A patch's DEP-3 header: ``Description:`` (the patch's summary, then the
docstring of the module defining it), ``Origin:``, ``Bug:`` (the mlx-lm
issues that docstring cites; pull requests it names are left out), ``Forwarded: no``,
``Last-Update:`` (changed only when the rest of the patch file changes).

References to this project's own issues ("(issue 4)") are left out: the
header is written for mlx-lm's maintainers.
"""

import datetime
import inspect
import os
import re
from pathlib import Path
from typing import List, Optional

from mlx_lm_patched._registry import Patch

from . import ROOT
from .rewrite import patch_module

ISSUES = "https://github.com/ml-explore/mlx-lm/issues/"
_BUG = re.compile(
    r"https://github\.com/ml-explore/mlx-lm/issues/(\d+)"
    r"|ml-explore/mlx-lm#(\d+)|(?<![\w/])#(\d+)\b"
)
# "PR #941", "PRs #941, #1322 and #1343": pull requests, not bugs.
_PULLS = re.compile(r"\bPRs?\s+(?:(?:ml-explore/mlx-lm)?#\d+(?:,\s+|\s+and\s+|\b))+")
# "(issue 4)", "(issues 4, 7)", "(issue 7: ...)": this project's tracker.
_OWN_ISSUE = re.compile(r" ?\(issues? \d+(?:, \d+)*(?:[:;][^)]*)?\)")


def bug_links(text: str) -> List[str]:
    """The mlx-lm issue URLs ``text`` cites (pull requests left out), in
    order, once each."""
    text = _PULLS.sub("", text)
    found = [ISSUES + next(g for g in m.groups() if g) for m in _BUG.finditer(text)]
    return list(dict.fromkeys(found))


def description(patch: Patch) -> List[str]:
    """The ``Description:`` field's lines."""
    module = patch_module(patch)
    doc = _OWN_ISSUE.sub("", inspect.getdoc(module) or "")
    body = doc.splitlines()
    if body and body[0].strip().rstrip(".") == patch.summary.strip().rstrip("."):
        body = body[1:]
    while body and not body[0].strip():
        body = body[1:]
    lines = [f"Description: {_OWN_ISSUE.sub('', patch.summary)}"]
    return lines + [f" {line}" if line.strip() else " ." for line in body]


def origin(patch: Patch) -> str:
    found = "vendor, mlx-lm-patched"
    module = patch_module(patch)
    if module is not None and getattr(module, "__file__", None):
        path = Path(module.__file__).resolve()
        found += (
            f" {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}"
        )
    return found


def today() -> str:
    epoch = os.environ.get("SOURCE_DATE_EPOCH")
    now = (
        datetime.datetime.fromtimestamp(int(epoch), datetime.timezone.utc)
        if epoch
        else datetime.datetime.now(datetime.timezone.utc)
    )
    return now.date().isoformat()


def _without_date(text: str) -> str:
    return re.sub(r"(?m)^Last-Update: .*\n", "", text, count=1)


def patch_file_text(patch: Patch, diff: str, old: Optional[str]) -> str:
    """Header + diff; ``Last-Update`` kept from ``old`` if nothing else changed."""
    desc = description(patch)
    head = desc + [f"Origin: {origin(patch)}"]
    head += [f"Bug: {b}" for b in bug_links("\n".join(desc))]
    head += ["Forwarded: no", "Last-Update: @DATE@", "---", ""]
    text = "\n".join(head) + diff
    if old is not None and _without_date(old) == _without_date(text):
        date = re.search(r"(?m)^Last-Update: (.*)$", old).group(1)
    else:
        date = today()
    return text.replace("Last-Update: @DATE@", f"Last-Update: {date}", 1)
