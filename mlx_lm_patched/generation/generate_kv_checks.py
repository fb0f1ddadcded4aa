"""``generate`` checks ``--kv-bits`` and ``--kv-group-size`` before the first token.

Upstream validates KV quantization only when a cache reaches
``quantized_kv_start`` tokens (5,000 by default): ``--kv-bits 16`` runs for
thousands of tokens, then fails mid-generation. And ``generate
--prompt-cache-file`` compares ``--kv-group-size`` with the group size the
file holds, so a quantized cache whose group size was lowered to fit its
head dims (96 with 64 quantizes with 32) is refused by the very command
that wrote it. Here ``maybe_quantize_kv_cache`` raises a ``ValueError``
naming ``kv_bits``/``kv_group_size`` and the valid values at the first model
call, and ``main`` asks the loaded cache whether it quantizes with the
requested group size (``QuantizedKVCache.quantizes_with``). A cache file
whose layer count or head layout is not the model's (upstream runs a 4-layer
cache on a 2- or 6-layer model with no error) is refused before the first
token (``prompt_cache_mismatch``).
"""

from .._registry import Patch, edits, targets

# Written as they read in mlx_lm/generate.py, and run there.


def _check_kv_quantization(kv_bits, kv_group_size):
    """Refuse what ``mx.quantize`` cannot do at the first model call, not
    when the cache reaches ``quantized_kv_start`` tokens."""
    if kv_bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(
            f"kv_bits (--kv-bits) must be 2, 3, 4, 5, 6 or 8, got {kv_bits}"
        )
    if kv_group_size not in (32, 64, 128):
        raise ValueError(
            f"kv_group_size (--kv-group-size) must be 32, 64 or 128, got {kv_group_size}"
        )


def maybe_quantize_kv_cache(prompt_cache, quantized_kv_start, kv_group_size, kv_bits):
    if kv_bits is None:
        return
    _check_kv_quantization(kv_bits, kv_group_size)
    for e, c in enumerate(prompt_cache):
        if hasattr(c, "to_quantized") and c.offset >= quantized_kv_start:
            prompt_cache[e] = c.to_quantized(group_size=kv_group_size, bits=kv_bits)


# main: a prompt cache file's group size may be one lowered to fit its head
# dims; a file of other layers or head dims is refused before generating.
_MAIN = """\
@@ -19,3 +19,3 @@
                 )
-            if args.kv_group_size != prompt_cache[0].group_size:
+            if not prompt_cache[0].quantizes_with(args.kv_group_size):
                 raise ValueError(
@@ -50,2 +50,14 @@
     )
+    if using_cache:
+        # A cache of other layers or head dims runs on, or fails mid-generation.
+        from .models.cache import prompt_cache_layout, prompt_cache_mismatch
+
+        probe = make_prompt_cache(model)
+        model(mx.array([[0]]), cache=probe)
+        mismatch = prompt_cache_mismatch(prompt_cache_layout(probe), prompt_cache)
+        if mismatch is not None:
+            raise ValueError(
+                f"{args.prompt_cache_file} does not fit the model {model_path}: "
+                f"{mismatch}"
+            )
     for eos_token in args.extra_eos_token:
"""


PATCH = Patch(
    "generate_kv_checks",
    "generate: --kv-bits/--kv-group-size checked before the first token; a "
    "prompt cache file's lowered group size accepted, one of another layout "
    "refused",
    targets("mlx_lm.generate", _check_kv_quantization, maybe_quantize_kv_cache)
    + edits("mlx_lm.generate", main=_MAIN),
    requires=(
        "mlx_lm.models.cache:QuantizedKVCache.quantizes_with",
        "mlx_lm.models.cache:prompt_cache_mismatch",  # main imports it
    ),
)
