"""mlx-lm-patched: mlx-lm's KV caches, preallocated and finished.

Importing this package applies every patch in ``PATCHES`` to the installed
mlx-lm (set ``MLX_LM_PATCHED_APPLY=0`` to import without patching; a vendored
mlx-lm, ``make vendor``'s wheel, has them in its source already). Each
patch lives in the module named for what it fixes; ``status()`` tells which
are applied and whether upstream still matches what they were written for.
"""

import importlib
import os
import warnings
from typing import Dict, List

try:
    importlib.import_module("mlx.core")
except ImportError as e:  # MLX's Linux wheel without a back-end
    raise ImportError(
        f"{e}. On Linux, MLX needs a back-end: install with an extra, "
        '`pip install "mlx-lm-patched[cpu]"` (or [cuda12], [cuda13])'
    ) from e

from . import _apply, _registry
from ._apply import PatchDriftError, PatchDriftWarning
from ._registry import UPSTREAM_VERSION, fingerprint, get_original
from .caches import (
    batch_quantized,
    batch_rotating_prealloc,
    batch_rotating_rows,
    kvcache_pipeline,
    max_kv_size,
    negative_trim,
    quantized_cache,
    quantized_ring,
    ring_trim_slack,
    rotating_prealloc,
)
from .generation import (
    batch_generator_kv_bits,
    first_token_early,
    generate_kv_checks,
    prompt_batch_split,
    speculative_bounded,
)
from .kernels import bounded_attention, quantized_attention, quantized_decode_kernel
from .prompt_cache import (
    host_export,
    prompt_cache_blocks,
    prompt_cache_dir,
    prompt_cache_disk,
    prompt_cache_disk_blocks,
    prompt_cache_files,
    prompt_cache_store,
    prompt_trie_search,
)
from .serving import (
    server_failures,
    server_http,
    server_kv_bits,
    server_max_kv_size,
    server_models,
    server_prompt_cache,
    server_readiness,
    server_request_pickup,
    server_requests,
    server_shared_prefill,
    server_token_logprob,
    server_warmup,
)

__version__ = "0.1.0"
__all__ = [
    "PATCHES",
    "UPSTREAM_VERSION",
    "PatchDriftError",
    "PatchDriftWarning",
    "apply",
    "batch_generate",
    "fingerprint",
    "generate",
    "get_original",
    "load",
    "revert",
    "status",
    "stream_generate",
]

# Apply order; a patch may only require patches listed before it. Each
# patch is its module's ``PATCH``: the module says what it fixes and why.
MODULES = (
    rotating_prealloc,  # cache.py: RotatingKVCache
    batch_rotating_prealloc,  # cache.py: BatchRotatingKVCache
    batch_rotating_rows,  # cache.py: BatchRotatingKVCache merge & co.
    bounded_attention,  # base.py: scaled_dot_product_attention
    prompt_cache_files,  # cache.py: load_prompt_cache, _check_state
    negative_trim,  # cache.py: KVCache & co. trim(n < 0) raises
    quantized_cache,  # cache.py: QuantizedKVCache, KVCache.to_quantized
    quantized_decode_kernel,  # base.py: a CUDA decode kernel, packed cache
    quantized_attention,  # base.py: quantized_scaled_dot_product_attention
    host_export,  # cache.py: prompt_cache_to_host, HostPromptCache
    generate_kv_checks,  # generate.py: --kv-bits checked up front
    max_kv_size,  # cache.py: make_prompt_cache
    quantized_ring,  # cache.py: QuantizedRotatingKVCache
    batch_quantized,  # cache.py: BatchQuantizedKVCache, merges
    batch_generator_kv_bits,  # generate.py: BatchGenerator(kv_bits=...)
    server_kv_bits,  # server.py: batching with --kv-bits
    ring_trim_slack,  # cache.py: trim_prompt_cache exact or raises
    speculative_bounded,  # generate.py: --draft-model with bounded caches
    prompt_cache_blocks,  # cache.py: PromptBlocks, shared prefix blocks
    prompt_cache_store,  # cache.py: LRUPromptCache
    prompt_cache_dir,  # cache.py: PromptCacheDir, a directory servers share
    prompt_cache_disk_blocks,  # cache.py: PromptBlockDir, shared block files
    prompt_cache_disk,  # cache.py: DiskPromptCache
    server_prompt_cache,  # server.py: run, --prompt-cache-bytes
    kvcache_pipeline,  # cache.py: KVCache, BatchKVCache long chunks pipelined
    server_failures,  # server.py: a failing or abandoned request ends alone
    server_requests,  # server.py: bad requests get a 400 naming the parameter
    server_max_kv_size,  # server.py: --max-kv-size rings in _serve_single
    server_http,  # server.py: bursts, idle timeouts, a bounded stop
    server_models,  # server.py: /v1/models without a hub cache
    prompt_trie_search,  # cache.py: PromptTrie.search in linear time
    server_warmup,  # server.py: made-up tokens served once at start
    prompt_batch_split,  # generate.py: a split of every row moves the batch
    first_token_early,  # generate.py: a row's first token before the next step
    server_request_pickup,  # server.py: a queued request taken at the next step
    server_shared_prefill,  # server.py: a shared prefix in flight is waited for
    server_token_logprob,  # server.py: a token logprob read only where asked
    server_readiness,  # server.py: /health 503 until loaded and warmed up
)
PATCHES: List[_registry.Patch] = [m.PATCH for m in MODULES]
# patch name -> its folder (caches, kernels, generation, prompt_cache, serving)
FOLDERS: Dict[str, str] = {m.PATCH.name: m.__name__.split(".")[1] for m in MODULES}
_apply.check_disjoint(PATCHES)
_apply.check_requires(PATCHES)
_apply.check_needs(PATCHES)


def _select(names) -> List[_registry.Patch]:
    known = {p.name: p for p in PATCHES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown patch(es) {unknown}; known: {list(known)}")
    return [p for p in PATCHES if not names or p.name in names]


def apply(*names: str, strict: bool = False) -> List[str]:
    """Apply all (or the named) patches; idempotent. Returns the applied names:
    none on a vendored mlx-lm, whose source has them already."""
    if _apply.vendored():
        return []
    return _apply.apply_patches(_select(names), strict=strict)


def revert(*names: str) -> List[str]:
    """Restore the exact upstream objects of all (or the named) patches, and
    of the applied patches that need them (with a warning naming those).
    Returns the names reverted."""
    reverted = _apply.revert_patches(_select(names))
    if names and set(reverted) - set(names):
        warnings.warn(
            f"mlx_lm_patched: reverting {list(names)} also reverted "
            f"{[n for n in reverted if n not in names]}, which need it",
            stacklevel=2,
        )
    return reverted


def status() -> Dict[str, dict]:
    """Per patch: applied, what it needs, the mlx-lm it targets, and where
    the installed one differs: the objects merged onto other source, or why
    the patch is set aside."""
    installed = _apply.installed_version()
    return {
        p.name: {
            "applied": _apply.is_applied(p.name),
            "folder": FOLDERS.get(p.name, ""),
            "summary": p.summary,
            "requires": _apply.requirements(p),
            "written_for": UPSTREAM_VERSION,
            "installed": installed,
            "drift": [d for t in p.targets if (d := t.drift())],
        }
        for p in PATCHES
    }


if os.environ.get("MLX_LM_PATCHED_APPLY", "1") != "0":
    apply()


def __getattr__(name: str):
    """mlx-lm's entry points as the patches leave them now (``apply`` after
    ``revert`` builds edited functions anew). Importing the ``generate`` front
    module binds that name to the module, which stays callable as the function.
    """
    if name in ("batch_generate", "generate", "load", "stream_generate"):
        import mlx_lm

        return getattr(mlx_lm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
