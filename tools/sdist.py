"""The pinned (or any) mlx-lm sdist, fetched with pip into ``.upstream/``."""

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import textwrap
from pathlib import Path
from typing import List, Sequence

from mlx_lm_patched._registry import UPSTREAM_VERSION

from . import ROOT

CACHE = Path(os.environ.get("MLX_LM_PATCHED_UPSTREAM_CACHE", ROOT / ".upstream"))


class UpstreamUnavailable(RuntimeError):
    """The mlx-lm sdist could not be downloaded."""


def _download(version: str) -> Path:
    """The sdist archive of ``version`` ("latest": the newest) in CACHE."""
    with tempfile.TemporaryDirectory(dir=CACHE) as d:
        spec = "mlx-lm" if version == "latest" else f"mlx-lm=={version}"
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps"]
        cmd += ["--no-binary", ":all:", "--disable-pip-version-check", "-q"]
        cmd += [spec, "-d", d]
        r = subprocess.run(cmd, capture_output=True, text=True)
        found = sorted(Path(d).glob("*.tar.gz"))
        if r.returncode or not found:
            raise UpstreamUnavailable(
                f"could not download the mlx-lm {version} sdist "
                f"({' '.join(cmd[1:])}): {(r.stderr or r.stdout).strip()[-800:]}"
            )
        archive = CACHE / found[0].name
        os.replace(found[0], archive)
        return archive


def sdist_tree(version: str = UPSTREAM_VERSION) -> Path:
    """The extracted sdist of mlx-lm ``version``, downloaded once into CACHE.

    Treat it as read-only: copy it (``fresh_tree``) before patching.
    """
    tree = CACHE / f"mlx_lm-{version}"
    if (tree / "PKG-INFO").exists():
        return tree
    CACHE.mkdir(parents=True, exist_ok=True)
    archive = CACHE / f"mlx_lm-{version}.tar.gz"
    if not archive.exists():
        archive = _download(version)
        tree = CACHE / archive.name.removesuffix(".tar.gz")
        if (tree / "PKG-INFO").exists():
            return tree
    with tempfile.TemporaryDirectory(dir=CACHE) as d:
        with tarfile.open(archive) as tf:
            if hasattr(tarfile, "data_filter"):
                tf.extractall(d, filter="data")
            else:  # pragma: no cover - Python < 3.11.4
                tf.extractall(d)
        (top,) = [p for p in Path(d).iterdir() if p.is_dir()]
        try:
            os.replace(top, tree)
        except OSError:
            if not (tree / "PKG-INFO").exists():
                raise
    return tree


def fresh_tree(dest: Path, version: str = UPSTREAM_VERSION) -> Path:
    """A writable copy of the sdist tree at ``dest`` (which must not exist)."""
    shutil.copytree(sdist_tree(version), dest)
    return dest


def module_file(module: str, tree: Path) -> str:
    """Path of ``module`` relative to the sdist root."""
    rel = module.replace(".", "/")
    if (tree / rel / "__init__.py").exists():
        return f"{rel}/__init__.py"
    return f"{rel}.py"


def import_errors(tree: Path, files: Sequence[str]) -> List[str]:
    """Import ``tree``'s modules ``files`` (sdist-relative paths) in a fresh
    interpreter, from ``tree``; what went wrong, if anything."""
    modules = [
        rel[: -len(".py")].replace("/", ".").removesuffix(".__init__") for rel in files
    ]
    if not modules:
        return []
    code = (
        "import importlib, sys\n"
        "for m in sys.argv[1:]:\n"
        "    f = importlib.import_module(m).__file__\n"
        "    assert f.startswith(sys.path[0]), f'{m} imported from {f}'\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tree), "MLX_LM_PATCHED_APPLY": "0"}
    r = subprocess.run(
        [sys.executable, "-c", code, *modules],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
    )
    if r.returncode == 0:
        return []
    last = (r.stderr or r.stdout).strip().splitlines()[-6:]
    return [
        f"the patched {', '.join(modules)} do not import:\n"
        + textwrap.indent("\n".join(last), "    ")
    ]
