"""``dist/mlx_lm-<pinned>+patched.N``: a wheel of the sdist with the series
(N patches) applied, for ``pip install`` without ``mlx_lm_patched``."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from mlx_lm_patched._registry import UPSTREAM_VERSION

from . import DIST_DIR, PATCH_DIR
from .sdist import fresh_tree, import_errors
from .series import apply_series, is_source, read_series, touched_files


def vendor_version(patch_dir: Path = PATCH_DIR) -> str:
    return f"{UPSTREAM_VERSION}+patched.{len(read_series(patch_dir))}"


def build_wheel(out_dir: Path = DIST_DIR, patch_dir: Path = PATCH_DIR) -> Path:
    """Build ``mlx_lm-<pinned>+patched.N`` from the sdist with the series applied."""
    version = vendor_version(patch_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="mlx-lm-vendor-") as d:
        work = fresh_tree(Path(d) / f"mlx_lm-{version}")
        for a in apply_series(work, patch_dir):
            if not a.ok:
                raise RuntimeError(f"{a.name} does not apply:\n{a.output}")
        sources = [f for f in touched_files(patch_dir) if is_source(f)]
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
    return wheel
