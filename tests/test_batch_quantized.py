"""Batched quantized caches: merge, filter, extend, extract and save/load
bit-exact; batched prompt caches give their single streams' tokens."""

import copy
import inspect
import itertools
import socket

import mlx.core as mx
import pytest
from fuzzing import Layout, apply_batch_op, batch_ops, fuzz, layouts, snapshot
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.generate import BatchGenerator, batch_generate
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)
from ringref import (
    PROMPTS,
    attend,
    random_kv,
    same,
    same_mask,
    save_load,
    single_stream,
)


def quantized(n, bits=8, seed=0):
    mx.random.seed(seed)
    c = QuantizedKVCache(group_size=64, bits=bits)
    if n:
        c.update_and_fetch(*random_kv(1, 2, n, 64))
    return c


def test_quantized_prompt_caches_can_be_batched(patched, load_tiny):
    model, tokenizer = load_tiny("llama")
    kw = dict(kv_bits=8, quantized_kv_start=0)
    caches = [single_stream(model, p, 1, **kw)[1] for p in PROMPTS]
    assert {type(c) for cache in caches for c in cache} == {QuantizedKVCache}
    more = [[7, 8, 9], [3], [11, 12]]
    out = batch_generate(
        model, tokenizer, more, prompt_caches=copy.deepcopy(caches),
        max_tokens=30, return_token_ids=True, **kw,
    )  # fmt: skip
    for p, cache, tokens in zip(more, caches, out.token_ids):
        assert tokens == single_stream(model, p, 30, cache=cache, **kw)[0]


def test_upstream_cannot_batch_quantized_prompt_caches(upstream, load_tiny):
    model, tokenizer = load_tiny("llama")
    with pytest.raises(ValueError, match="does not yet support batching"):
        batch_generate(model, tokenizer, [[1, 2]], prompt_caches=[[quantized(5)] * 4])
    assert "kv_bits" not in inspect.signature(BatchGenerator).parameters


def test_merge_then_extract_gives_each_cache_back_bit_exact(patched):
    caches = [quantized(n, seed=n) for n in (7, 0, 19)]
    batch = QuantizedKVCache.merge(caches)
    assert type(batch).__name__ == "BatchQuantizedKVCache"
    assert batch.offset.tolist() == [7, 0, 19] and batch.size() == 19
    for i, c in enumerate(caches):
        row = batch.extract(i)
        assert type(row) is QuantizedKVCache and row.offset == c.offset
        if c.offset:
            assert same(row.keys_and_values(), c.keys_and_values())
            assert (row.dtype, row.head_dims) == (c.dtype, c.head_dims)


def test_upstream_merges_quantized_caches_into_an_empty_cache(upstream):
    assert BatchKVCache.merge([quantized(7), quantized(3)]).keys is None


def test_batch_kv_cache_merge_of_quantized_caches_is_quantized(patched):
    batch = BatchKVCache.merge([KVCache(), quantized(5)])
    assert type(batch).__name__ == "BatchQuantizedKVCache"
    assert batch.offset.tolist() == [0, 5]


def test_filter_and_extend_keep_rows_bit_exact(patched):
    caches = [quantized(n, seed=n) for n in (4, 9, 6)]
    batch = QuantizedKVCache.merge(caches[:2])
    batch.filter([1])
    batch.extend(QuantizedKVCache.merge(caches[2:]))
    assert batch.offset.tolist() == [9, 6]
    for i, c in enumerate(caches[1:]):
        assert same(batch.extract(i).keys_and_values(), c.keys_and_values())


def test_extend_quantizes_an_unquantized_batch(patched):
    fp = KVCache()
    fp.update_and_fetch(*random_kv(1, 2, 5, 64))
    batch = QuantizedKVCache.merge([quantized(8)])
    batch.extend(KVCache.merge([fp]))
    row = batch.extract(1)
    want = mx.quantize(fp.keys[..., :5, :], 64, 8)
    assert same(row.keys_and_values()[0], tuple(want))


def dequantized(parts, bits=8):
    return mx.dequantize(*parts, group_size=64, bits=bits)


def roundtrip(x, bits=8):
    return dequantized(mx.quantize(x, 64, bits), bits)


def test_attention_sees_the_fp_batch_quantized_through_padding_and_decode(patched):
    fp = BatchKVCache([2, 0])
    q = fp.to_quantized(group_size=64, bits=8)
    for c in (fp, q):
        c.prepare(lengths=[3, 5], right_padding=[2, 0])
    steps = [random_kv(2, 2, 5, 64)] + [random_kv(2, 2, 1, 64) for _ in range(4)]
    for i, (k, v) in enumerate(steps):
        if i == 1:
            fp.finalize(), q.finalize()
        masks = [c.make_mask(k.shape[2], return_array=True) for c in (fp, q)]
        assert same(*masks)
        fk, fv = [mx.array(x) for x in fp.update_and_fetch(k, v)]
        qk, qv = [dequantized(p) for p in q.update_and_fetch(k, v)]
        assert same(qk, roundtrip(fk)) and same(qv, roundtrip(fv))
        assert same(q.offset, fp.offset) and same(q.left_padding, fp.left_padding)
    assert q.trim(2) == 2 and same(q.offset, fp.offset - 2)


def test_batch_quantized_cache_survives_save_and_load_bit_exact(patched, tmp_path):
    batch = QuantizedKVCache.merge([quantized(7), quantized(12, bits=8, seed=1)])
    save_prompt_cache(str(tmp_path / "b.safetensors"), [batch])
    (loaded,) = load_prompt_cache(str(tmp_path / "b.safetensors"))
    assert type(loaded) is type(batch)
    assert same(list(loaded.state), list(batch.state))


def ring_batch(lengths, max_size=16, keep=4, dims=64):
    """A BatchRotatingKVCache filled with right-padded prompts of ``lengths``."""
    B, S = len(lengths), max(lengths)
    fp = BatchRotatingKVCache(max_size, [0] * B, keep)
    fp.prepare(lengths=lengths, right_padding=[S - n for n in lengths])
    return fp


def test_quantized_batch_ring_sees_the_fp_ring_quantized_token_by_token(patched):
    fp = ring_batch([5, 9, 3])
    q = fp.to_quantized(group_size=64, bits=8)
    assert type(q).__name__ == "BatchQuantizedRotatingKVCache"
    steps = [9, 1, 1, 7, 1, 20] + [1] * 12
    for i, S in enumerate(steps):
        if i == 1:
            fp.finalize(), q.finalize()
        k, v = random_kv(3, 2, S, 64)
        masks = [c.make_mask(S, window_size=12) for c in (fp, q)]
        assert same(*masks)
        fk, fv = [mx.array(x) for x in fp.update_and_fetch(k, v)]
        qk, qv = [dequantized(p) for p in q.update_and_fetch(k, v)]
        assert same(qk, roundtrip(fk)) and same(qv, roundtrip(fv))
        assert same(q.left_padding, fp.left_padding) and q._idx == fp._idx
    for i in range(3):
        row, want = q.extract(i), fp.extract(i)
        assert type(row).__name__ == "QuantizedRotatingKVCache"
        assert (row.offset, row._idx) == (want.offset, want._idx)
        assert same(dequantized(row.keys), roundtrip(want.keys))


def test_quantized_rings_merge_filter_extend_and_extract_bit_exact(patched):
    rings = []
    for n in (3, 20, 0, 11):
        r = RotatingKVCache(16, keep=4).to_quantized(group_size=64, bits=4)
        if n:
            r.update_and_fetch(*random_kv(1, 2, n, 64))
        rings.append(r)
    batch = type(rings[0]).merge(rings[:2])
    batch.filter([1, 0])
    batch.extend(type(rings[0]).merge(rings[2:]))
    for i, want in enumerate([rings[1], rings[0], rings[2], rings[3]]):
        row = batch.extract(i)
        assert row.offset == want.offset
        if want.offset:
            temporal = [want.to_kv_cache(), row.to_kv_cache()]
            k = [c._temporal_order(c.keys) for c in temporal]
            assert same(*k)


def test_quantized_batch_ring_survives_save_and_load_bit_exact(patched, tmp_path):
    fp = ring_batch([5, 9])
    fp.update_and_fetch(*random_kv(2, 2, 9, 64))
    fp.finalize()
    q = fp.to_quantized(group_size=64, bits=4)
    save_prompt_cache(str(tmp_path / "r.safetensors"), [q])
    (loaded,) = load_prompt_cache(str(tmp_path / "r.safetensors"))
    assert type(loaded) is type(q)
    assert same(list(loaded.state), list(q.state))
    k, v = random_kv(2, 2, 1, 64)
    assert same(
        [dequantized(p, 4) for p in loaded.update_and_fetch(k, v)],
        [dequantized(p, 4) for p in q.update_and_fetch(k, v)],
    )


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ring_states(tmp_path):
    """Rings of 16 slots, keep 4, in every state a batch may meet."""
    mx.random.seed(3)
    fresh = RotatingKVCache(16, keep=4)
    fp = RotatingKVCache(16, keep=4)
    fp.update_and_fetch(*random_kv(1, 2, 9, 64))
    wrapped = RotatingKVCache(16, keep=4)
    for _ in range(25):
        wrapped.update_and_fetch(*random_kv(1, 2, 1, 64))
    quantized_ring = RotatingKVCache(16, keep=4)
    quantized_ring.update_and_fetch(*random_kv(1, 2, 12, 64))
    quantized_ring = quantized_ring.to_quantized(64, 8)
    path = str(tmp_path / "ring.safetensors")
    save_prompt_cache(path, [wrapped.to_quantized(64, 8)])
    loaded = load_prompt_cache(path)[0]
    return dict(
        fresh=fresh, fp=fp, wrapped=wrapped, quantized=quantized_ring, loaded=loaded
    )


def attention_seen(cache, new_k, new_v, q):
    """What one decode query attends to after ``cache`` takes ``new_k``/``new_v``,
    keys and values dequantized if the cache is quantized."""
    mask = cache.make_mask(1, window_size=16)  # as models do, before the update
    k, v = cache.update_and_fetch(new_k, new_v)
    if isinstance(k, tuple):
        k, v = (mx.dequantize(*x, group_size=64, bits=8) for x in (k, v))
    if isinstance(mask, mx.array) and mask.ndim == 1:
        mask = mask[None]
    return attend(q, k, v, mask)


def test_rings_of_every_kind_and_state_merge_in_every_order(patched, tmp_path):
    rings = ring_states(tmp_path)
    new_k, new_v = random_kv(3, 2, 1, 64)
    q = mx.random.normal((3, 2, 1, 64))
    for order in itertools.permutations(rings, 3):
        caches = [copy.deepcopy(rings[name]) for name in order]
        batch = caches[0].merge(caches)
        quantized = any(hasattr(c, "bits") for c in caches)
        assert hasattr(batch, "bits") == quantized
        got = attention_seen(batch, new_k, new_v, q)
        for i, (name, cache) in enumerate(zip(order, caches)):
            if quantized and not hasattr(cache, "bits"):
                cache = cache.to_quantized(64, 8)
            row = slice(i, i + 1)
            want = attention_seen(cache, new_k[row], new_v[row], q[row])
            assert mx.allclose(got[row], want, atol=1e-5).item(), (order, name)


@pytest.mark.parametrize("family", ["llama_sliding", "gemma3_text"])
def test_batch_generate_merges_fresh_and_quantized_prompt_caches_in_either_order(
    patched, load_tiny, family
):
    model, tokenizer = load_tiny(family)
    kw = dict(kv_bits=8, quantized_kv_start=0)
    history = single_stream(model, list(range(3, 40)), 1, **kw)[1]
    fresh = make_prompt_cache(model)
    more = [[7, 8, 9], [11, 12]]
    for caches in ([fresh, history], [history, fresh]):
        out = batch_generate(
            model, tokenizer, more, prompt_caches=copy.deepcopy(caches),
            max_tokens=20, return_token_ids=True, **kw,
        )  # fmt: skip
        for prompt, cache, tokens in zip(more, caches, out.token_ids):
            # A quantized batch holds every row quantized, a fresh one from
            # its first token: alone, that row is the same stream.
            alone = [c if hasattr(c, "bits") else c.to_quantized(64, 8) for c in cache]
            want = single_stream(model, prompt, 20, cache=alone, **kw)
            assert tokens == want[0][: len(tokens)]


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
