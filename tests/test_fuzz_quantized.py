"""Differential fuzzing of the quantized caches with hypothesis.

Each example runs a random sequence of operations on a quantized cache and,
side by side, on the patched fp cache of the same kind fed the very same
tokens quantized and dequantized (so both hold exactly the same numbers),
and checks after every step: offsets and padding, masks, the tokens attention
is handed (dequantized), attention through the quantized path against plain
attention over the fp cache, and the dequantized export. Example count as in
``test_fuzz.py``: ``MLX_LM_PATCHED_FUZZ_EXAMPLES`` (100 unless set).
"""

import mlx.core as mx
import pytest
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)
from ringref import attend, random_kv, reference_mask, save_load
from test_fuzz import apply_batch_op, batch_ops, dequantized, fuzz, ring_sessions

pytestmark = pytest.mark.usefixtures("patched")

H, Q = 2, 4  # key/value heads, query heads (grouped-query attention)


def same(a, b):
    """Bit-exact equality of arrays, tuples of them and plain values."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, mx.array) and isinstance(b, mx.array):
        return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()
    return type(a) is type(b) and a == b


def same_mask(fp, q):
    """Equal masks, the fp ring's single-query vector as the quantized row."""
    if isinstance(fp, mx.array) and fp.ndim == 1:
        fp = fp[None]
    return same(fp, q)


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


# QuantizedRotatingKVCache against the patched RotatingKVCache


def check_ring_state(ours, fp, window):
    assert (ours.offset, ours._idx, ours.size()) == (fp.offset, fp._idx, fp.size())
    assert ours.is_trimmable() == fp.is_trimmable()
    for N in (1, 2, fp.max_size, fp.max_size + 1):
        got = ours.make_mask(N, window_size=window, return_array=True)
        assert same_mask(fp.make_mask(N, window_size=window, return_array=True), got)
    kv = ours.to_kv_cache()
    assert type(kv) is RotatingKVCache
    if fp.offset == 0:
        assert kv.offset == 0
    else:
        assert same(kv.state, fp.state)


@fuzz
@given(ring_sessions(), layouts, st.integers(0, 2**31 - 1))
def test_quantized_ring_equals_the_fp_ring_fed_the_quantized_tokens(
    session, layout, seed
):
    """Updates of 1 to ``2 * max_size`` tokens, trims and save/load: the
    quantized ring keeps the fp ring's offsets, slots and masks, hands
    attention exactly the fp ring's tokens, attends as plain attention over
    them (which sees the reference window) and exports the fp ring's state."""
    max_size, keep, window, ops = session
    mx.random.seed(seed)
    fp = RotatingKVCache(max_size, keep)
    ours = RotatingKVCache(max_size, keep).to_quantized(layout.group_size, layout.bits)
    hk, hv = (mx.zeros((1, H, 0, layout.dim), layout.dtype) for _ in range(2))
    for op, n in ops:
        if op == "trim":
            if not fp.is_trimmable():
                continue
            trimmed = fp.trim(n)
            assert ours.trim(n) == trimmed == min(n, hk.shape[2])
            hk, hv = hk[..., : fp.offset, :], hv[..., : fp.offset, :]
        elif op == "save_load":
            before = ours.state
            ours, fp = save_load(ours), save_load(fp)
            assert same(ours.state, before)
        else:
            (k, v), (rk, rv) = layout.kv(1, n)
            q = layout.queries(1, n)
            offset = fp.offset
            fmask = fp.make_mask(n, window_size=window)
            qmask = ours.make_mask(n, window_size=window)
            assert same_mask(fmask, qmask)
            fkv = snapshot(fp.update_and_fetch(rk, rv))
            qkv = snapshot(ours.update_and_fetch(k, v))
            assert same([layout.tokens(ours, p) for p in qkv], fkv)
            got, want = layout.attention(q, ours, qkv, qmask, fkv, fmask)
            assert layout.close(got, want)
            hk = mx.concatenate([hk, rk], axis=2)
            hv = mx.concatenate([hv, rv], axis=2)
            window_seen = min(window or max_size, max_size)
            ref_mask = reference_mask(offset, n, window_seen, keep)
            _, ref = layout.attention(q, ours, qkv, qmask, (hk, hv), ref_mask)
            assert mx.allclose(want, ref, atol=1e-5).item()
        assert fp.offset == hk.shape[2]
        check_ring_state(ours, fp, window)


# BatchQuantizedKVCache and BatchQuantizedRotatingKVCache against the patched
# BatchKVCache and BatchRotatingKVCache


class Twins:
    """A quantized batch cache and the fp one beside it, fed the same rows."""

    def __init__(self, ring, layout, max_size, keep, lengths):
        self.ring, self.layout = ring, layout
        self.max_size, self.keep = max_size, keep
        singles = [self.singles(n) for n in lengths]
        self.fp = (BatchRotatingKVCache if ring else BatchKVCache).merge(
            [f for f, _ in singles]
        )
        self.q = type(singles[0][1]).merge([q for _, q in singles])
        self.check_state()

    def singles(self, n):
        g, b = self.layout.group_size, self.layout.bits
        if self.ring:
            fp = RotatingKVCache(self.max_size, self.keep)
            q = RotatingKVCache(self.max_size, self.keep).to_quantized(g, b)
        else:
            fp, q = KVCache(), QuantizedKVCache(group_size=g, bits=b)
        if n:
            (k, v), (rk, rv) = self.layout.kv(1, n)
            fp.update_and_fetch(rk, rv)
            q.update_and_fetch(k, v)
        return fp, q

    @property
    def B(self):
        return self.fp.offset.shape[0]

    def room(self):
        """Columns left until the ring's window is full (0 once it is, or
        without a ring)."""
        if not self.ring:
            return 0
        return max(0, self.max_size - self.keep - self.fp._offset)

    def check_state(self):
        assert type(self.q).__name__ == (
            "BatchQuantizedRotatingKVCache" if self.ring else "BatchQuantizedKVCache"
        )
        assert same(self.q.offset, self.fp.offset)
        assert same(self.q.left_padding, self.fp.left_padding)
        assert self.q._idx == self.fp._idx and self.q.size() == self.fp.size()
        assert self.q.is_trimmable() == self.fp.is_trimmable()
        for N in (1, 3):
            masks = [c.make_mask(N, return_array=True) for c in (self.fp, self.q)]
            assert same(*masks)

    def check(self, S, lengths=None):
        """One update of ``S`` columns (rows with ``lengths`` right-padded);
        True if every real query attends in both as in the fp cache."""
        return self.check_prefill([S], lengths)

    def check_prefill(self, chunks, lengths=None):
        """``sum(chunks)`` columns in ``chunks``, rows with ``lengths`` real
        tokens right-padded (prepare, the chunks, finalize); True if every
        real query attends in both as in the fp cache."""
        total = sum(chunks)
        lengths = lengths or [total] * self.B
        if min(lengths) < total:
            for c in (self.fp, self.q):
                c.prepare(lengths=lengths, right_padding=[total - n for n in lengths])
        ok, start = True, 0
        for S in chunks:
            (k, v), (rk, rv) = self.layout.kv(self.B, S)
            queries = self.layout.queries(self.B, S)
            fmask, qmask = self.fp.make_mask(S), self.q.make_mask(S)
            assert same(fmask, qmask)
            fkv = snapshot(self.fp.update_and_fetch(rk, rv))
            qkv = snapshot(self.q.update_and_fetch(k, v))
            got = [self.layout.tokens(self.q, p) for p in qkv]
            if not self.ring:
                # BatchKVCache's columns left of a row's padding are masked
                # out, whatever they hold: finalize rolls the whole buffer,
                # and the two caches' capacities differ.
                real = mx.arange(fkv[0].shape[2]) >= self.fp.left_padding[:, None]
                real = real[:, None, :, None]
                got, fkv = ([mx.where(real, x, 0) for x in kv] for kv in (got, fkv))
            assert same(got, fkv)
            got, want = self.layout.attention(queries, self.q, qkv, qmask, fkv, fmask)
            real = [min(max(n - start, 0), S) for n in lengths]
            ok &= all(
                self.layout.close(got[b, :, :n], want[b, :, :n])
                for b, n in enumerate(real)
            )
            start += S
        for c in (self.fp, self.q):
            c.finalize()
        return ok

    def check_extract(self, b):
        """Row ``b`` on its own: the dequantized export equals the fp row,
        and a decode step on both attends alike."""
        if self.fp.keys is None:  # upstream BatchKVCache cannot extract then
            q = self.q.extract(b)
            return q.offset == 0 and q.keys is None
        fp, q = self.fp.extract(b), self.q.extract(b)
        assert type(q) is (quantized_ring_class() if self.ring else QuantizedKVCache)
        assert q.offset == fp.offset
        if fp.offset:
            assert same(q.to_kv_cache().state, fp.state)
        (k, v), (rk, rv) = self.layout.kv(1, 1)
        queries = self.layout.queries(1, 1)
        fmask, qmask = (
            c.make_mask(1, window_size=None, return_array=False) for c in (fp, q)
        )
        assert same_mask(fmask, qmask)
        fkv = snapshot(fp.update_and_fetch(rk, rv))
        qkv = snapshot(q.update_and_fetch(k, v))
        assert same([self.layout.tokens(q, p) for p in qkv], fkv)
        got, want = self.layout.attention(queries, q, qkv, qmask, fkv, fmask)
        return self.layout.close(got, want)

    def filter(self, rows):
        for c in (self.fp, self.q):
            c.filter(mx.array(rows))

    def extend(self, n):
        fp, q = self.singles(n)
        self.fp.extend(type(self.fp).merge([fp]))
        self.q.extend(type(q).merge([q]))

    def trim(self, n):
        """Trim ``n`` tokens, at most what the shortest row holds (further
        leaves negative offsets, in upstream's BatchKVCache too)."""
        if self.fp.is_trimmable():
            n = min(n, *self.fp.offset.tolist())
            assert self.q.trim(n) == self.fp.trim(n)

    def save_load(self):
        before = self.q.state
        self.q, self.fp = save_load(self.q), save_load(self.fp)
        # Upstream BatchKVCache's state setter leaves this unset (its
        # finalize then raises); the twin only needs it as __init__ sets it.
        if not self.ring and not hasattr(self.fp, "_right_padding"):
            self.fp._right_padding = None
        assert same(self.q.state, before)


def quantized_ring_class():
    """The patched class (it exists only while ``quantized_ring`` is applied)."""
    from mlx_lm.models import cache

    return cache.QuantizedRotatingKVCache


@st.composite
def batch_sessions(draw):
    ring = draw(st.booleans())
    max_size = draw(st.sampled_from([4, 6, 8, 16]))
    keep = draw(st.sampled_from([k for k in (0, 0, 1, 2, 4) if k < max_size - 1]))
    lengths = draw(st.lists(st.integers(0, 2 * max_size), min_size=1, max_size=3))
    op = batch_ops(max_size, extend_from=0, trim=True)
    ops = draw(st.lists(op, min_size=1, max_size=12))
    return ring, max_size, keep if ring else 0, lengths, ops


@fuzz
@given(
    batch_sessions(),
    layouts,
    st.integers(0, 2**31 - 1),
    st.randoms(use_true_random=False),
)
def test_quantized_batch_equals_the_fp_batch_fed_the_quantized_tokens(
    session, layout, seed, rng
):
    """Merge quantized singles (rings with or without keep, or plain), then
    decode, chunks, right-padded chunks and prefills in several chunks,
    extract, filter, extend, trim and
    save/load in any order: offsets, padding and masks are the fp batch's,
    attention is handed exactly its tokens, and every real query of every row
    attends as it does over the fp batch."""
    ring, max_size, keep, lengths, ops = session
    mx.random.seed(seed)
    twins = Twins(ring, layout, max_size, keep, lengths)
    for op, n in ops:
        assert apply_batch_op(twins, op, n, rng)
        twins.check_state()


def test_merge_of_quantized_rings_takes_the_group_size_the_tokens_use():
    layout = Layout(64, 4, 96, "float32")
    mx.random.seed(0)
    twins = Twins(True, layout, 8, 0, [0, 3])
    assert twins.q.group_size == 32
    assert twins.check(1)
    assert twins.check_extract(1)
