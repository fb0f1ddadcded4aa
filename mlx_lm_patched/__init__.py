"""mlx-lm-patched: mlx-lm's KV caches, preallocated and finished.

Importing this package applies every patch in ``PATCHES`` to the installed
mlx-lm (set ``MLX_LM_PATCHED_APPLY=0`` to import without patching). Each
patch lives in the module named for what it fixes; ``status()`` tells which
are applied and whether upstream still matches what they were written for.
"""

import os
from typing import Dict, List

from . import (
    _registry,
    batch_quantized,
    batch_rotating_prealloc,
    bounded_attention,
    max_kv_size,
    prompt_cache_files,
    quantized_cache,
    quantized_ring,
    rotating_prealloc,
)
from ._registry import (
    UPSTREAM_VERSION,
    PatchDriftError,
    PatchDriftWarning,
    fingerprint,
    get_original,
)

__version__ = "0.1.0"

# Apply order; a patch may only require patches listed before it.
PATCHES: List[_registry.Patch] = [
    rotating_prealloc.PATCH,
    batch_rotating_prealloc.PATCH,
    bounded_attention.PATCH,
    prompt_cache_files.PATCH,
    quantized_cache.PATCH,
    max_kv_size.PATCH,
    quantized_ring.PATCH,
    batch_quantized.PATCH,
]


def _select(names) -> List[_registry.Patch]:
    known = {p.name: p for p in PATCHES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown patch(es) {unknown}; known: {list(known)}")
    return [p for p in PATCHES if not names or p.name in names]


def apply(*names: str, strict: bool = False) -> List[str]:
    """Apply all (or the named) patches; idempotent. Returns the applied names."""
    return _registry.apply_patches(_select(names), strict=strict)


def revert(*names: str) -> None:
    """Restore the exact upstream objects of all (or the named) patches."""
    _registry.revert_patches(_select(names))


def status() -> Dict[str, dict]:
    """Per patch: applied, the mlx-lm it targets, and any upstream drift."""
    installed = _registry.installed_version()
    return {
        p.name: {
            "applied": _registry.is_applied(p.name),
            "summary": p.summary,
            "written_for": UPSTREAM_VERSION,
            "installed": installed,
            "drift": [d for t in p.targets if (d := t.drift())],
        }
        for p in PATCHES
    }


if os.environ.get("MLX_LM_PATCHED_APPLY", "1") != "0":
    apply()

# ``generate`` is mlx-lm's function; importing the ``generate`` front module
# rebinds the name to that module, which stays callable as the function.
from mlx_lm import batch_generate, generate, load, stream_generate  # noqa: E402
