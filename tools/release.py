"""Do the patches fit an mlx-lm release? Per patch: ``clean`` (that release
has the upstream source every target was written for), ``merged`` (our
changes merge three ways onto its other source, as at run time) or
``conflict`` (it changed lines we change, removed what we use, or a patch
it needs is set aside); per target the same, read from the release's source
text. Also, for information, whether the quilt series applies with fuzz."""

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from mlx_lm_patched import _apply, _newmods
from mlx_lm_patched._registry import UPSTREAM_VERSION, Patch, fingerprint_source

from .rewrite import (
    GenerateError,
    _merged_source,
    apply_to_sources,
    is_removal,
    split_owner,
)
from .sdist import fresh_tree, module_file, sdist_tree
from .series import Series, apply_series, read_series
from .source import NotFound, find_class, source_from_text


@dataclass
class TargetCheck:
    patch: str
    where: str
    status: str  # "match" | "new" | "merged" | "conflict" | "missing" | "exists"
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status in ("match", "new", "merged")


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
        return "conflict", "no longer a function"
    fp = fingerprint_source(src)
    inherited = (
        f" (inherited from {found_in})" if found_in not in (cls, "module") else ""
    )
    if fp == t.fingerprint:
        return "match", f"{fp}{inherited}"
    try:
        _merged_source(text, t, cls)
    except GenerateError as e:
        return "conflict", str(e)
    return "merged", f"fingerprint {fp}, written for {t.fingerprint}{inherited}"


_NEW = {False: ("new", ""), True: ("exists", "a file upstream now has")}


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
            if _newmods.is_new(t.new):  # a new file: upstream must not have one
                found = (tree / t.new.file).exists()
                out.append(TargetCheck(patch.name, t.new.file, *_NEW[found]))
                continue
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


def merge_onto(
    patches: Sequence[Patch], tree: Path
) -> Tuple[Dict[str, str], Dict[str, str]]:
    """``(files, status)``: the source files of ``tree`` the patches change,
    with every patch that merges applied, and per patch ``clean``,
    ``merged`` or why it is set aside (a conflict, or needing one that is)."""
    files: Dict[str, str] = {}
    status: Dict[str, str] = {}
    aside: set = set()
    checks = check_targets(patches, tree)
    for patch in patches:
        mine = [c for c in checks if c.patch == patch.name]
        needs = [r for r in _apply.requirements(patch) if r in aside]
        if needs:
            status[patch.name] = f"set aside: needs {', '.join(needs)}"
        else:
            try:
                files = apply_to_sources(files, patch, tree)
                merged = any(c.status == "merged" for c in mine)
                status[patch.name] = "merged" if merged else "clean"
                continue
            except GenerateError as e:
                status[patch.name] = f"conflict: {e}"
        aside |= {patch.name} | {t.name for t in patch.targets}
        # As at run time, its helpers stay for the patches that use them.
        helpers = Patch(
            patch.name, "", [t for t in patch.targets if _apply._is_helper(t)]
        )
        # Alone, they need only the global names they read (``_needs``).
        if helpers.targets and not set(_apply._needs(helpers.targets)) & aside:
            try:
                files = apply_to_sources(files, helpers, tree)
                aside -= {t.name for t in helpers.targets}
            except GenerateError:
                pass
    return files, status


def check_release(patches: Sequence[Patch], version: str) -> Tuple[bool, str]:
    """(ok, report) for mlx-lm ``version`` ("latest": the newest release)."""
    tree = sdist_tree(version)
    version = tree.name[len("mlx_lm-") :]
    checks = check_targets(patches, tree)
    _, status = merge_onto(patches, tree)
    lines = [f"mlx-lm {version} (patches written for {UPSTREAM_VERSION})"]
    for name, how in status.items():
        lines.append(f"  {name}: {how}")
        lines += [
            f"    {c.status:8} {c.where}" + (f"  [{c.detail}]" if c.detail else "")
            for c in checks
            if c.patch == name and c.status != "match"
        ]
    with tempfile.TemporaryDirectory(prefix="mlx-lm-release-") as d:
        applied = apply_series(fresh_tree(Path(d) / "tree", version), exact=False)
    names = read_series()
    lines.append("  the quilt series (patches/, for information):")
    for a in applied:
        how = "FAILS" if not a.ok else "applies with offset/fuzz" if a.inexact else ""
        lines.append(f"    {how or 'applies':24} {a.name}")
    lines += [f"    {'not tried':24} {name}" for name in names[len(applied) :]]
    ok = all(how in ("clean", "merged") for how in status.values())
    counts = {
        k: sum(v.startswith(k) for v in status.values()) for k in ("clean", "merged")
    }
    lines.append(
        f"check-release {version}: {'OK' if ok else 'CONFLICT'} ({counts['clean']} "
        f"clean, {counts['merged']} merged, "
        f"{len(status) - sum(counts.values())} set aside)"
    )
    return ok, "\n".join(lines)
