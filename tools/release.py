"""Do the patches fit an mlx-lm release? Per patch and target: does that
release still have the upstream source each target was written for (its
fingerprint, read from the release's source text), and does the series
apply to it."""

import tempfile
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from mlx_lm_patched._registry import UPSTREAM_VERSION, Patch, fingerprint_source

from .rewrite import GenerateError, apply_to_sources, is_removal, split_owner
from .sdist import fresh_tree, module_file, sdist_tree
from .series import Series, apply_series, read_series
from .source import NotFound, find_class, source_from_text


@dataclass
class TargetCheck:
    patch: str
    where: str
    status: str  # "match" | "new" | "changed" | "missing" | "exists"
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("match", "new")


def _check(t, cls: Optional[str], text: str) -> Tuple[str, str]:
    """(status, detail) of target ``t`` against the module source ``text``."""
    try:
        src, found_in = source_from_text(text, cls, t.attr)
    except NotFound as e:
        return "missing", str(e)
    if t.fingerprint is None:
        if found_in == "absent":
            return "new", ""
        return "exists", f"now defined in {found_in}"
    if found_in == "absent":
        return "missing", ""
    if src is None:
        return "changed", "no longer a function"
    fp = fingerprint_source(src)
    inherited = (
        f" (inherited from {found_in})" if found_in not in (cls, "module") else ""
    )
    if fp == t.fingerprint:
        return "match", f"{fp}{inherited}"
    return "changed", f"fingerprint {fp}, written for {t.fingerprint}{inherited}"


def check_targets(
    patches: Sequence[Patch], tree: Path, series: Optional[Series] = None
) -> List[TargetCheck]:
    """Each target's recorded fingerprint against ``tree``'s source text (for
    a class an earlier patch adds, against that patch's source of it, from
    ``series`` if it was generated already)."""
    out: List[TargetCheck] = []
    texts: Dict[str, Optional[str]] = {}
    current: Optional[Dict[str, str]] = {}  # None once a patch cannot be written
    for i, patch in enumerate(patches):
        for t in patch.targets:
            module, cls = split_owner(t.owner)
            where = f"{module}.{cls + '.' if cls else ''}{t.attr}"
            where += " (removed)" if is_removal(t) else ""
            rel = module_file(module, tree)
            if rel not in texts:
                path = tree / rel
                texts[rel] = path.read_text() if path.exists() else None
            text = texts[rel]
            if text is None:
                out.append(TargetCheck(patch.name, where, "missing", f"no {rel}"))
                continue
            if cls and find_class(text, cls) is None and current:
                patched = current.get(rel)
                if patched and find_class(patched, cls) is not None:
                    text = patched
                    where += " (class added by an earlier patch)"
            out.append(TargetCheck(patch.name, where, *_check(t, cls, text)))
        if series is not None:
            current = series.steps[i][1]
        elif current is not None:
            try:
                current = apply_to_sources(current, patch, tree)
            except GenerateError:
                current = None
    return out


def check_release(patches: Sequence[Patch], version: str) -> Tuple[bool, str]:
    """(ok, report) for mlx-lm ``version`` ("latest": the newest release)."""
    tree = sdist_tree(version)
    version = tree.name[len("mlx_lm-") :]
    checks = check_targets(patches, tree)
    lines = [f"mlx-lm {version} (patches written for {UPSTREAM_VERSION})"]
    for name in dict.fromkeys(c.patch for c in checks):
        mine = [c for c in checks if c.patch == name]
        lines.append(f"  {name}: {'matches' if all(c.ok for c in mine) else 'DRIFTED'}")
        lines += [
            f"    {c.status:8} {c.where}" + (f"  [{c.detail}]" if c.detail else "")
            for c in mine
        ]
    with tempfile.TemporaryDirectory(prefix="mlx-lm-release-") as d:
        applied = apply_series(fresh_tree(Path(d) / "tree", version), exact=False)
    names = read_series()
    lines.append("  series:")
    for a in applied:
        how = "FAILS" if not a.ok else "applies with offset/fuzz" if a.inexact else ""
        lines.append(f"    {how or 'applies':24} {a.name}")
        if how:
            lines.append(textwrap.indent(a.output, "      "))
    lines += [f"    {'not tried':24} {name}" for name in names[len(applied) :]]
    ok = (
        all(c.ok for c in checks)
        and all(a.ok for a in applied)
        and len(applied) == len(names)
    )
    lines.append(f"check-release {version}: {'OK' if ok else 'DRIFT'}")
    return ok, "\n".join(lines)
