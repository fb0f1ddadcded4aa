"""``patches/``: every patch as a DEP-3 header and a unified diff against the
pinned sdist (its source and its tests), in ``PATCHES`` order, listed in
``patches/series``; patch N applies on top of 1..N-1 with ``patch -p1``."""

import difflib
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from mlx_lm_patched._registry import Patch

from . import PATCH_DIR
from .dep3 import patch_file_text
from .rewrite import GenerateError, apply_to_sources
from .source import lines_of, undefined_names
from .testedits import apply_test_edits

PATCH_FILE = re.compile(r"^\d\d-.+\.patch$")


def patch_name(i: int, patch: Patch) -> str:
    return f"{i + 1:02d}-{patch.name}.patch"


def is_source(rel: str) -> bool:
    """Whether ``rel`` (sdist-relative) is mlx-lm's code, not its tests."""
    return rel.startswith("mlx_lm/")


@dataclass
class Series:
    files: Dict[str, str]  # file name in patches/ -> content, "series" included
    final: Dict[str, str]  # sdist-relative path -> text with every patch
    warnings: List[str] = field(default_factory=list)
    # (patch file name, every file changed so far -> its text after this patch)
    steps: List[Tuple[str, Dict[str, str]]] = field(default_factory=list)


def _diff(rel: str, before: str, after: str) -> List[str]:
    """The unified diff of ``rel``; ``before`` empty: a new file."""
    if not after.endswith("\n") or not before.endswith("\n") and before:
        raise GenerateError(f"{rel}: no newline at end of file")
    old = f"a/{rel}" if before else "/dev/null"
    return list(
        difflib.unified_diff(lines_of(before), lines_of(after), old, f"b/{rel}", n=3)
    )


def generate(
    patches: Sequence[Patch], tree: Path, patch_dir: Optional[Path] = None
) -> Series:
    """Every patch file (and ``series``) as they should be in ``patch_dir``."""
    patch_dir = PATCH_DIR if patch_dir is None else patch_dir
    files: Dict[str, str] = {}
    current: Dict[str, str] = {}
    names, warnings, steps = [], [], []
    for i, patch in enumerate(patches):
        after = apply_test_edits(apply_to_sources(current, patch, tree), patch, tree)
        diff = []
        for rel in sorted(after, key=lambda r: (not is_source(r), r)):
            before = current.get(rel)
            if before is None:
                before = (tree / rel).read_text() if (tree / rel).exists() else ""
            if before == after[rel]:
                continue
            diff += _diff(rel, before, after[rel])
            missing = undefined_names(after[rel], rel) - undefined_names(before, rel)
            if missing:
                warnings.append(
                    f"patch {patch.name!r}: {rel} uses {sorted(missing)} but does not "
                    "define them (add a module-level target or an import for each)"
                )
        if not diff:
            warnings.append(f"patch {patch.name!r} changes nothing")
        name = patch_name(i, patch)
        old_path = patch_dir / name
        old = old_path.read_text() if old_path.exists() else None
        files[name] = patch_file_text(patch, "".join(diff), old)
        names.append(name)
        steps.append((name, after))
        current = after
    files["series"] = "".join(f"{n}\n" for n in names)
    return Series(files, current, warnings, steps)


def write_patches(series: Series, patch_dir: Path = PATCH_DIR) -> List[str]:
    """Write the series; remove stale ``NN-*.patch`` files. Returns changes."""
    patch_dir.mkdir(parents=True, exist_ok=True)
    changed = []
    for name, text in series.files.items():
        path = patch_dir / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            changed.append(name)
    for path in sorted(patch_dir.iterdir()):
        if PATCH_FILE.match(path.name) and path.name not in series.files:
            path.unlink()
            changed.append(f"{path.name} (removed)")
    return changed


def compare_patches(series: Series, patch_dir: Path = PATCH_DIR) -> List[str]:
    """How ``patch_dir`` differs from the regenerated series."""
    problems = []
    for name, text in series.files.items():
        path = patch_dir / name
        if not path.exists():
            problems.append(f"{name}: missing")
            continue
        old = path.read_text()
        if old != text:
            delta = list(
                difflib.unified_diff(
                    lines_of(old),
                    lines_of(text),
                    f"{name} (in patches/)",
                    f"{name} (regenerated)",
                    n=1,
                )
            )
            shown = "".join(delta[:30]) + ("  ...\n" if len(delta) > 30 else "")
            problems.append(f"{name}: differs from the regenerated patch\n{shown}")
    if patch_dir.exists():
        for path in sorted(patch_dir.iterdir()):
            if PATCH_FILE.match(path.name) and path.name not in series.files:
                problems.append(f"{path.name}: not in PATCHES (stale)")
    return problems


def read_series(patch_dir: Path = PATCH_DIR) -> List[str]:
    path = patch_dir / "series"
    if not path.exists():
        return []
    return [
        line.strip()
        for line in path.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def touched_files(patch_dir: Path = PATCH_DIR) -> List[str]:
    """The sdist-relative files the series changes."""
    found = []
    for name in read_series(patch_dir):
        text = (patch_dir / name).read_text()
        found += re.findall(r"(?m)^\+\+\+ b/(\S+)", text)
    return list(dict.fromkeys(found))


@dataclass
class Applied:
    name: str
    ok: bool
    output: str

    @property
    def inexact(self) -> bool:
        return "offset" in self.output or "fuzz" in self.output


def apply_series(
    tree: Path, patch_dir: Path = PATCH_DIR, exact: bool = True
) -> List[Applied]:
    """Apply the series to ``tree`` with ``patch -p1``, stopping at a failure."""
    if shutil.which("patch") is None:
        raise RuntimeError("the `patch` program is not installed")
    done = []
    for name in read_series(patch_dir):
        cmd = ["patch", "-p1", "--batch", "--forward", "--no-backup-if-mismatch"]
        cmd += ["--fuzz=0"] if exact else []
        cmd += ["-d", str(tree), "-i", str((patch_dir / name).resolve())]
        r = subprocess.run(cmd, capture_output=True, text=True)
        done.append(Applied(name, r.returncode == 0, (r.stdout + r.stderr).strip()))
        if r.returncode:
            break
    return done
