"""``dist/mlx_lm-<version>+patched.N``: a wheel of an mlx-lm sdist with N
patches applied, for ``pip install`` without ``mlx_lm_patched``: the pinned
release gets the quilt series; another release gets every patch that merges
onto it (``release.merge_onto``), the rest set aside and reported."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, Tuple

from mlx_lm_patched._registry import UPSTREAM_VERSION

from . import DIST_DIR, PATCH_DIR, all_patches
from .release import merge_onto
from .sdist import fresh_tree, import_errors, sdist_tree
from .series import apply_series, is_source, read_series, touched_files


def vendor_version(patch_dir: Path = PATCH_DIR) -> str:
    return f"{UPSTREAM_VERSION}+patched.{len(read_series(patch_dir))}"


def build_wheel(
    out_dir: Path = DIST_DIR, patch_dir: Path = PATCH_DIR, release: str = ""
) -> Tuple[Path, Dict[str, str]]:
    """Build ``mlx_lm-<release>+patched.N``; return it and, per patch, how
    it went onto that release (``clean`` for the pinned one's series)."""
    release = release or UPSTREAM_VERSION
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlx-lm-vendor-") as d:
        if release == UPSTREAM_VERSION:
            version = vendor_version(patch_dir)
            work = fresh_tree(Path(d) / f"mlx_lm-{version}")
            for a in apply_series(work, patch_dir):
                if not a.ok:
                    raise RuntimeError(f"{a.name} does not apply:\n{a.output}")
            sources = [f for f in touched_files(patch_dir) if is_source(f)]
            status = {name: "clean" for name in read_series(patch_dir)}
        else:
            tree = sdist_tree(release)
            release = tree.name[len("mlx_lm-") :]
            files, status = merge_onto(all_patches(), tree)
            done = [n for n, how in status.items() if how in ("clean", "merged")]
            version = f"{release}+patched.{len(done)}"
            work = fresh_tree(Path(d) / f"mlx_lm-{version}", release)
            for rel, text in files.items():
                (work / rel).write_text(text)
            sources = sorted(files)
        errors = import_errors(work, sources)
        if errors:
            raise RuntimeError("\n".join(errors))
        env = dict(os.environ)
        env["SETUPTOOLS_SCM_PRETEND_VERSION_FOR_MLX_LM"] = version
        env["SETUPTOOLS_SCM_PRETEND_VERSION"] = version
        env.setdefault("SOURCE_DATE_EPOCH", "315532800")  # reproducible zip entries
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q"]
        cmd += ["--disable-pip-version-check", "-w", str(out_dir), str(work)]
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if r.returncode:
            raise RuntimeError(f"wheel build failed:\n{(r.stdout + r.stderr)[-3000:]}")
    wheel = out_dir / f"mlx_lm-{version}-py3-none-any.whl"
    if not wheel.exists():
        raise RuntimeError(f"pip built no {wheel.name} in {out_dir}")
    return wheel, status
