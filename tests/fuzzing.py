"""Shared pieces of the differential fuzz (hypothesis).

Each fuzz test runs random operation sequences on one cache and checks
every step against a plain reference and, where upstream is right, upstream
run side by side; the quantized caches against the fp cache of the same kind
fed the very same tokens quantized and dequantized. Fuzz tests carry the
``fuzz`` marker: CI runs ``MLX_LM_PATCHED_FUZZ_EXAMPLES`` (100 unless set)
examples each, ``make fuzz`` 10,000.
"""

import itertools
import os

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from mlx_lm.models import cache as cache_module
from mlx_lm.models.base import scaled_dot_product_attention
from ringref import attend, random_kv

EXAMPLES = int(os.environ.get("MLX_LM_PATCHED_FUZZ_EXAMPLES", "100"))
H, Q = 2, 4  # key/value heads, query heads (grouped-query attention)


def fuzz(test):
    """A hypothesis test run ``EXAMPLES`` times, marked ``fuzz``."""
    run = settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    return pytest.mark.fuzz(run(test))


@st.composite
def ring_sessions(draw):
    max_size = draw(st.integers(1, 12))
    keep = draw(st.integers(0, min(4, max_size - 1)))
    # A model's window_size; one above max_size is a sliding layer that
    # ``max_kv_size`` shrank, and must act as a window of max_size.
    window = draw(st.one_of(st.none(), st.integers(keep + 1, 2 * max_size)))
    window = None if window == max_size else window
    sizes = st.one_of(
        st.integers(1, 2 * max_size),
        st.sampled_from([1, max_size - 1, max_size, max_size + 1, 2 * max_size]),
    ).filter(bool)
    ops = st.one_of(
        st.tuples(st.just("update"), sizes),
        st.tuples(st.just("update"), st.just(1)),
        st.tuples(st.just("trim"), st.integers(0, max_size)),
        st.tuples(st.just("save_load"), st.just(0)),
    )
    return max_size, keep, window, draw(st.lists(ops, min_size=1, max_size=16))


@st.composite
def prefill_chunks(draw, S):
    """Chunk sizes of a right-padded prefill; a first chunk of None runs up
    to the end of the ring's window, so the next one runs past a full ring."""
    fill = draw(st.booleans())
    return [None] * fill + draw(st.lists(S, min_size=2 - fill, max_size=3))


def chunk_sizes(max_size):
    return st.one_of(
        st.integers(2, 2 * max_size),
        st.sampled_from([max_size - 1, max_size, max_size + 1]),
    )


def batch_ops(max_size, extend_from=1, trim=False):
    """One batch operation and its argument, for a batch ring of ``max_size``."""
    S = chunk_sizes(max_size)
    return st.one_of(
        st.tuples(st.just("decode"), st.just(1)),
        st.tuples(st.just("chunk"), S),
        st.tuples(st.just("padded"), S),
        st.tuples(st.just("prefill"), prefill_chunks(S)),
        st.tuples(st.just("extract"), st.integers(0, 5)),
        st.tuples(st.just("filter"), st.integers(1, 7)),
        st.tuples(st.just("extend"), st.integers(extend_from, 2 * max_size)),
        *([st.tuples(st.just("trim"), st.integers(0, max_size))] if trim else []),
        st.tuples(st.just("save_load"), st.just(0)),
    )


def apply_batch_op(harness, op, n, rng):
    """Run one ``batch_ops`` operation on ``harness`` (``Rows`` or the
    quantized fuzz's ``Twins``); False if a real query attended wrongly."""
    B = harness.B
    if op in ("decode", "chunk"):
        return harness.check(n)
    if op == "padded":
        padded = [n] + [rng.randint(1, n) for _ in range(B - 1)]
        rng.shuffle(padded)
        return harness.check(n, padded)
    if op == "prefill":  # right-padded, in chunks ``n``: prepare, chunks, finalize
        # A chunk of 1 would be decoding: prefills never leave one.
        chunks = [harness.room() if c is None else c for c in n]
        n = [c for c in chunks if c > 1] or [2]
        total, ends = sum(n), list(itertools.accumulate(n))
        # The other rows end anywhere, or where a chunk does.
        others = [rng.choice([rng.randint(1, total), *ends]) for _ in range(B - 1)]
        padded = [total] + others
        rng.shuffle(padded)
        return harness.check_prefill(n, padded)
    if op == "extract":
        return harness.check_extract(n % B)
    if op == "filter":
        harness.filter([b for b in range(B) if n >> b & 1] or [B - 1])
    elif op == "extend":
        harness.extend(n)
    elif op == "trim":
        harness.trim(n)
    else:
        harness.save_load()
    return True


def dequantized(x, group_size, bits, dim):
    """``x`` as a quantized cache of that layout must give it back."""
    g, width, _ = cache_module._kv_quant_layout(dim, dim, group_size, bits)
    if width > dim:
        x = mx.pad(x, [(0, 0), (0, 0), (0, 0), (0, width - dim)])
    x = mx.dequantize(*mx.quantize(x, group_size=g, bits=bits), group_size=g, bits=bits)
    return x[..., :dim]


def snapshot(x):
    """Copies: the next update writes into the buffers a cache returned."""
    if isinstance(x, (tuple, list)):
        return tuple(snapshot(y) for y in x)
    return mx.array(x)


class Layout:
    """How the quantized caches under test quantize, and that roundtrip."""

    def __init__(self, group_size, bits, dim, dtype):
        self.group_size, self.bits, self.dim = group_size, bits, dim
        self.dtype = getattr(mx, dtype)

    def kv(self, B, S):
        """Raw keys and values, and the same quantized-then-dequantized."""
        k, v = (x.astype(self.dtype) for x in random_kv(B, H, S, self.dim))
        return (k, v), tuple(self.roundtrip(x) for x in (k, v))

    def roundtrip(self, x):
        return dequantized(x, self.group_size, self.bits, self.dim)

    def queries(self, B, S):
        return mx.random.normal((B, Q, S, self.dim)).astype(self.dtype)

    def tokens(self, cache, parts):
        """The tokens of quantized ``parts`` as ``cache`` holds them."""
        x = mx.dequantize(*parts, group_size=cache.group_size, bits=cache.bits)
        return x[..., : self.dim]

    def attention(self, q, cache, qkv, qmask, fkv, fmask):
        """Quantized attention over ``qkv`` (as models run it), and plain
        float32 attention over the fp cache's ``fkv``."""
        scale = self.dim**-0.5
        # A copy: quantized attention scales its queries in place.
        got = scaled_dot_product_attention(mx.array(q), *qkv, cache, scale, qmask)
        fk, fv = (mx.repeat(x.astype(mx.float32), Q // H, 1) for x in fkv)
        want = attend(q.astype(mx.float32) * scale, fk, fv, fmask)
        return got.astype(mx.float32), want

    def close(self, a, b):
        # bfloat16 attention differs by rounding alone (the fp tokens are
        # rounded, quantized matmuls are not): there the tokens attention is
        # handed are checked bit for bit instead.
        if self.dtype != mx.float32:
            return True
        return mx.allclose(a, b, atol=1e-4, rtol=1e-4).item()


layouts = st.builds(
    Layout,
    st.sampled_from([32, 64]),
    st.sampled_from([4, 8]),
    st.sampled_from([32, 64, 64, 80]),
    st.sampled_from(["float32", "float32", "bfloat16"]),
)
