"""``BatchGenerator(kv_bits=...)``: batches quantize their caches like ``generate_step``.

Upstream's ``BatchGenerator`` (and so ``batch_generate`` and the server's
batching) has no ``kv_bits``: batched generation always keeps full-precision
caches (ml-explore/mlx-lm#118, #126). Here it takes ``kv_bits``,
``kv_group_size`` and ``quantized_kv_start`` with ``generate_step``'s
meaning: after every model call, prefill chunk or decode step alike, a
batch's cache is quantized once its longest row (padding included) has
``quantized_kv_start`` tokens, so a batch of one gives the tokens
``generate_step`` gives. The call that takes a cache there quantizes each
layer as it writes it (``_QuantizeOnWrite``): attention still sees that
call's update in full precision, and the call never holds every layer's
full-precision cache. ``_extend_cache`` quantizes a batch joining a
quantized one.
"""

from typing import TYPE_CHECKING

import mlx.core as mx
import mlx.nn as nn

from .._newmods import hooks
from .._registry import Patch, cache_class, edits, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    from generate_kv_checks import (
        _check_kv_quantization,
    )
    from mlx_lm.models.ring_buffer import _pipeline

# Written as they would read in mlx_lm/generate.py, and run there.


def maybe_quantize_batch_cache(
    prompt_cache, coming, quantized_kv_start, kv_group_size, kv_bits
):
    """``maybe_quantize_kv_cache`` for a batch, before a model call adding
    ``coming`` columns: a cache that call takes to ``quantized_kv_start``
    columns (its longest row, padding included; read on the host, so that
    decoding never waits for it) is quantized as the call writes it."""
    if kv_bits is None:
        return
    _check_kv_quantization(kv_bits, kv_group_size)
    for e, c in enumerate(prompt_cache):
        if not hasattr(c, "to_quantized") or hasattr(c, "bits"):
            continue
        columns = c._offset if hasattr(c, "_offset") else c._idx
        if columns + coming >= quantized_kv_start:
            prompt_cache[e] = _QuantizeOnWrite(c, kv_group_size, kv_bits)


def _extend_cache(cache_a, cache_b):
    if not cache_a:
        return cache_b
    if not cache_b:
        return cache_a
    for i, (ca, cb) in enumerate(zip(cache_a, cache_b)):
        # One batch quantized, the other not yet: quantize it too.
        if hasattr(cb, "bits") and not hasattr(ca, "bits"):
            cache_a[i] = ca = ca.to_quantized(group_size=cb.group_size, bits=cb.bits)
        ca.extend(cb)
    return cache_a


class _QuantizeOnWrite:
    """A layer's cache that a model call takes past ``quantized_kv_start``.
    Its attention sees the update in full precision, as after that call
    ``to_quantized`` would find it, but the layer keeps the quantized copy
    from there on: a chunk never holds every layer's full-precision cache
    (on an H100, a 4 x 2,048-token chunk of a Llama-8B shape: 1 GiB)."""

    def __init__(self, cache, group_size, bits):
        self.cache, self.quantized = cache, None
        self.quantize = {"group_size": group_size, "bits": bits}

    def update_and_fetch(self, keys, values):
        cache = self.cache
        out = cache.update_and_fetch(keys, values)
        self.quantized = cache.to_quantized(**self.quantize)
        cache.keys = cache.values = None  # this layer's attention holds them
        # Scheduled with a long chunk's update (``[]``: waiting for nothing).
        q = self.quantized  # a batch ring packs its keys (and values) in one array
        held = [q.keys, q.values] if isinstance(q.keys, mx.array) else q.keys + q.values
        _pipeline(held, keys.shape[2], [])
        return out

    def __getattr__(self, name):  # not ``bits``: attention stays full precision
        return getattr(self.cache, name)


class _QuantizingModel:
    """``model``, its caches quantized as a call takes them past
    ``quantized_kv_start``."""

    def __init__(self, model: nn.Module, quantize):
        self.model = model
        self.quantize = quantize

    def __call__(self, inputs, cache=None, **kwargs):
        self.quantize(cache, inputs.shape[1])
        try:
            return self.model(inputs, cache=cache, **kwargs)
        finally:
            for e, c in enumerate(cache):
                if isinstance(c, _QuantizeOnWrite):
                    cache[e] = c.cache if c.quantized is None else c.quantized

    def __getattr__(self, name):
        return getattr(self.model, name)


_QuantizeOnWrite = cache_class("mlx_lm.generate", _QuantizeOnWrite)
_QuantizingModel = cache_class("mlx_lm.generate", _QuantizingModel)


# BatchGenerator.__init__: kv_bits, kv_group_size, quantized_kv_start.
_INIT = """\
@@ -12,4 +12,22 @@
     max_kv_size: Optional[int] = None,
+    kv_bits: Optional[int] = None,
+    kv_group_size: int = 64,
+    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START,
     stream=None,
 ):
+    # As in generate_step: after each model call, a cache is quantized
+    # once its longest row has seen ``quantized_kv_start`` tokens.
+    self.kv_bits = kv_bits
+    self.kv_group_size = kv_group_size
+    self.quantized_kv_start = quantized_kv_start
+    if kv_bits is not None:
+        model = _QuantizingModel(
+            model,
+            functools.partial(
+                maybe_quantize_batch_cache,
+                quantized_kv_start=quantized_kv_start,
+                kv_group_size=kv_group_size,
+                kv_bits=kv_bits,
+            ),
+        )
     self.model = model
"""


PATCH = Patch(
    "batch_generator_kv_bits",
    "BatchGenerator and batch_generate take kv_bits, kv_group_size and "
    "quantized_kv_start",
    targets(
        "mlx_lm.generate",
        maybe_quantize_batch_cache,
        _QuantizeOnWrite,
        _QuantizingModel,
        _extend_cache,
    )
    + hooks("mlx_lm.generate", "mlx_lm.models.ring_buffer", "_pipeline")
    + edits("mlx_lm.generate:BatchGenerator", __init__=_INIT),
    requires=(
        "mlx_lm.models.cache:BatchKVCache.to_quantized",
        "mlx_lm.models:ring_buffer",
    ),
)
