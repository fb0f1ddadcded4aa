"""Release tooling of mlx-lm-patched: never installed, run from the checkout.

``python -m tools COMMAND`` (see ``__main__``). Each module does one job:
``sdist`` fetches the pinned mlx-lm sdist, ``source`` reads definitions out
of source text, ``rewrite`` writes a patch into upstream's source,
``testedits`` writes a patch's upstream-style tests (``upstream_tests/``)
into upstream's test files, ``dep3`` writes a patch's header, ``series``
generates, compares, writes and applies ``patches/``, ``check`` checks it,
``release`` checks the patches against another mlx-lm release, ``vendor``
builds the patched wheel, ``suite`` runs upstream's test suite (with
``pytest_plugin`` recording each outcome).
"""

from pathlib import Path
from typing import List

ROOT = Path(__file__).resolve().parent.parent
PATCH_DIR = ROOT / "patches"
DIST_DIR = ROOT / "dist"


def all_patches() -> List:
    """``mlx_lm_patched.PATCHES``, in apply order."""
    import mlx_lm_patched

    return list(mlx_lm_patched.PATCHES)
