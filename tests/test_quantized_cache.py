"""QuantizedKVCache done right: sizes, bytes, growth, exports, layouts, tokens."""

import copy

import mlx.core as mx
import numpy as np
import pytest
from fuzzing import dequantized, fuzz
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models import base
from mlx_lm.models.base import (
    scaled_dot_product_attention,
)
from mlx_lm.models.cache import (
    KVCache,
    LRUPromptCache,
    QuantizedKVCache,
    load_prompt_cache,
    save_prompt_cache,
)
from ringref import (
    active,
    attend,
    random_kv,
    reference_mask,
    same,
    save_load,
    single_stream,
    upstream_twin,
)

import mlx_lm_patched
from mlx_lm_patched.caches import quantized_cache
from mlx_lm_patched.demo import tiny

pytestmark = pytest.mark.usefixtures("patched", "exact_active_memory")


def kv(n, dim=64, heads=2, dtype=mx.float32, seed=0, v_dim=None):
    """Deterministic N(0, 1) keys and values, (1, heads, n, dim)."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((1, heads, n, dim), dtype=np.float32)
    v = rng.standard_normal((1, heads, n, v_dim or dim), dtype=np.float32)
    return mx.array(k).astype(dtype), mx.array(v).astype(dtype)


def filled(n, group_size=64, bits=8, dtype=mx.float32, steps=None, **kw):
    cache = QuantizedKVCache(group_size=group_size, bits=bits)
    for i, s in enumerate(steps or [n]):
        cache.update_and_fetch(*kv(s, dtype=dtype, seed=i, **kw))
    mx.eval(cache.keys, cache.values)
    return cache


def quantized_bytes(n, dim=64, heads=2, group_size=64, bits=8, dtype=mx.float32):
    """Bytes mx.quantize gives ``n`` tokens of keys plus values."""
    q = mx.quantize(mx.zeros((1, heads, n, dim), dtype), group_size, bits)
    return 2 * sum(x.nbytes for x in q)


def bits_equal(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()


def same_state(a, b):
    sa, sb = a.state, b.state
    arrays = [(x, y) for x, y in zip(sa[0] + sa[1], sb[0] + sb[1])]
    return all(bits_equal(x, y) for x, y in arrays) and sa[2:] == sb[2:]


def test_size_is_live_tokens_and_trim_clamps_to_offset():
    cache = filled(0, steps=[7, 1, 300])
    assert cache.size() == cache.offset == 308
    assert cache.trim(8) == 8 and cache.size() == 300
    assert cache.trim(1000) == 300 and cache.size() == 0
    assert cache.trim(5) == 0


def test_negative_trim_raises_naming_cache_and_value_and_changes_nothing():
    cache = filled(10)
    keys, state = cache.keys, cache.state
    with pytest.raises(ValueError, match=r"QuantizedKVCache.*-3"):
        cache.trim(-3)
    assert cache.keys is keys and cache.offset == 10 and cache.state[2:] == state[2:]


def test_trim_update_and_export_work_when_keys_are_lists():
    cache = filled(20)
    state = list(cache.state)
    state[0], state[1] = list(state[0]), list(state[1])
    loaded = QuantizedKVCache.from_state(state)
    legacy = QuantizedKVCache.from_state(state[:5])  # upstream's 5-tuple state
    assert legacy.dtype == "float32" and legacy.head_dims == (64, 64)
    for c in (loaded, legacy):
        c.keys, c.values = list(c.keys), list(c.values)  # as some servers assign
        assert c.trim(5) == 5 and c.size() == 15
        c.update_and_fetch(*kv(3, seed=9))
        assert c.size() == 18 and c.to_kv_cache().keys.shape[2] == 18
        c.compact()
        assert c.nbytes == quantized_bytes(18)
    assert same_state(loaded, legacy)


def test_compact_frees_trimmed_tokens_and_nbytes_is_exactly_live_bytes():
    cache = filled(1000)
    held = cache.nbytes
    cache.trim(700)
    before = active()
    cache.compact()
    assert cache.nbytes == quantized_bytes(300)
    assert before - active() == held - quantized_bytes(300)
    cache.trim(300)
    cache.compact()
    assert cache.nbytes == 0 and cache.empty()


def test_nbytes_is_zero_when_empty_and_matches_active_memory():
    assert QuantizedKVCache().nbytes == 0
    before = active()
    cache = filled(0, steps=[100, 1, 1, 200])
    assert cache.nbytes == active() - before
    assert cache.nbytes >= quantized_bytes(302)


def test_reserve_allocates_once_for_the_whole_length():
    cache = QuantizedKVCache()
    cache.reserve(500)
    buffers = set()
    for i, s in enumerate([100] + [1] * 50 + [350]):
        cache.update_and_fetch(*kv(s, seed=i))
        mx.eval(cache.keys)
        buffers.add(cache.keys[0].shape[2])
    assert buffers == {500} and cache.nbytes == quantized_bytes(500)


def test_growth_is_geometric_and_never_holds_more_than_old_and_new():
    cache = filled(256)
    capacities, worst = [256], 0
    for i in range(90):
        k, v = kv(32, seed=i)
        mx.eval(k, v)
        old, base = cache.nbytes, mx.get_active_memory()
        mx.reset_peak_memory()
        cache.update_and_fetch(k, v)
        mx.eval(cache.keys, cache.values)
        worst = max(worst, mx.get_peak_memory() - base - old - cache.nbytes)
        if cache.keys[0].shape[2] != capacities[-1]:
            capacities.append(cache.keys[0].shape[2])
    assert cache.size() == 256 + 90 * 32
    assert capacities == [256, 512, 768, 1280, 2048, 3072, 4608]
    assert worst <= 0  # no concatenate spike: old buffers plus new ones, at most


def test_to_kv_cache_dequantizes_live_tokens_to_the_original_dtype():
    keys, values = kv(300, dtype=mx.bfloat16)
    errors = {}
    for bits in (8, 4):
        cache = QuantizedKVCache(group_size=64, bits=bits)
        cache.update_and_fetch(keys, values)
        cache.update_and_fetch(*kv(5, dtype=mx.bfloat16, seed=1))
        cache.trim(5)
        out = cache.to_kv_cache()
        assert isinstance(out, KVCache) and out.offset == 300
        assert out.keys.dtype == mx.bfloat16 and out.keys.shape == keys.shape
        # The same values as dequantizing what mx.quantize made of the keys.
        ref = mx.dequantize(*mx.quantize(keys, 64, bits), 64, bits)
        assert bits_equal(out.keys, ref.astype(mx.bfloat16))
        # Upstream's error levels on N(0, 1) (float32, so bfloat16 adds none).
        keys32 = keys.astype(mx.float32)
        cache = QuantizedKVCache(group_size=64, bits=bits)
        cache.update_and_fetch(keys32, keys32)
        diff = cache.to_kv_cache().keys - keys32
        errors[bits] = mx.abs(diff).mean().item()
    assert errors[8] < 0.005 and errors[4] < 0.08


def test_to_quantized_quantizes_only_live_tokens_and_records_dtype():
    cache = KVCache()
    cache.update_and_fetch(*kv(300, dtype=mx.bfloat16))
    cache.trim(100)
    q = cache.to_quantized(group_size=64, bits=8)
    mx.eval(q.keys, q.values)
    assert q.offset == 200 and q.dtype == "bfloat16"
    assert q.nbytes == quantized_bytes(200, dtype=mx.bfloat16)
    assert KVCache().to_quantized().nbytes == 0


def test_to_quantized_holds_an_update_s_bits_and_waits_for_no_other_layer(
    monkeypatch,
):
    """Converting a 2048-token layer (``generate_step`` converts every layer
    after the first chunk) gives the arrays an update of those tokens would,
    and schedules nothing: an update of 256 tokens or more waits for the
    previous layer's (``_pipeline``), a round trip to the GPU a layer."""
    keys, values = kv(2048, dim=80, dtype=mx.bfloat16)
    cache = KVCache()
    cache.update_and_fetch(keys, values)
    updated = QuantizedKVCache(group_size=32, bits=4)
    updated.update_and_fetch(keys, values)
    scheduled = []
    monkeypatch.setattr(mx, "async_eval", lambda *a: scheduled.append(a))
    q = cache.to_quantized(group_size=32, bits=4)
    assert scheduled == []
    monkeypatch.undo()
    assert (q.offset, q.group_size, q.bits) == (2048, 32, 4)
    assert (q.dtype, tuple(q.head_dims)) == ("bfloat16", (80, 80))
    for a, b in zip((*q.keys, *q.values), (*updated.keys, *updated.values)):
        assert a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b)
    q.update_and_fetch(*kv(3, dim=80, dtype=mx.bfloat16))  # keeps working
    assert q.offset == 2051 and q.keys_and_values()[0][0].shape[2] == 2051


def test_save_load_keeps_group_size_bits_dtype_and_the_cache_keeps_working(tmp_path):
    cache = filled(0, bits=4, dtype=mx.bfloat16, dim=96, steps=[70, 1])
    assert cache.group_size == 32  # 96 is no multiple of 64
    path = str(tmp_path / "q.safetensors")
    save_prompt_cache(path, [cache])
    (loaded,) = load_prompt_cache(path)
    assert same_state(loaded, cache)
    assert (loaded.group_size, loaded.bits, loaded.dtype) == (32, 4, "bfloat16")
    assert loaded.nbytes == quantized_bytes(
        71, 96, group_size=32, bits=4, dtype=mx.bfloat16
    )
    for c in (cache, loaded):
        c.trim(10)
        c.update_and_fetch(*kv(4, dim=96, dtype=mx.bfloat16, seed=7))
    assert same_state(loaded, cache)
    assert bits_equal(loaded.to_kv_cache().keys, cache.to_kv_cache().keys)


@pytest.mark.parametrize("head_dim", [96, 80])
def test_head_dims_no_group_size_divides_generate_with_kv_bits(head_dim):
    model = tiny.build_model(tiny.model_config("llama", head_dim=head_dim))
    prompt = mx.array(list(range(3, 40)))
    cache = [KVCache() for _ in model.layers]
    out = generate_step(
        prompt, model, max_tokens=4, kv_bits=8, quantized_kv_start=0, prompt_cache=cache
    )
    assert len([t for t, _ in out]) == 4
    assert all(isinstance(c, QuantizedKVCache) and c.group_size == 32 for c in cache)
    assert cache[0].to_kv_cache().keys.shape[-1] == head_dim
    # Padded attention equals attention over the dequantized keys and values.
    queries = mx.array(np.random.default_rng(1).standard_normal((1, 4, 3, head_dim)))
    q = QuantizedKVCache(bits=8)
    keys, values = q.update_and_fetch(*kv(20, dim=head_dim))
    ref = q.to_kv_cache()
    want = mx.fast.scaled_dot_product_attention(
        queries, ref.keys, ref.values, scale=0.1, mask=None
    )
    got = scaled_dot_product_attention(
        queries, keys, values, cache=q, scale=0.1, mask=None
    )
    assert got.shape == (1, 4, 3, head_dim) and mx.allclose(got, want, atol=1e-4)


def test_impossible_layouts_and_mismatched_updates_raise_before_any_change():
    with pytest.raises(ValueError, match="80 and 72"):
        QuantizedKVCache().update_and_fetch(*kv(3, dim=80, v_dim=72))
    with pytest.raises(ValueError, match="bits=7"):
        QuantizedKVCache(bits=7).update_and_fetch(*kv(3))
    cache = filled(10)
    keys, state = cache.keys, cache.state
    for bad in (kv(2, dim=128), kv(2, heads=4), kv(2, v_dim=32)):
        with pytest.raises(ValueError, match="QuantizedKVCache holds"):
            cache.update_and_fetch(*bad)
        assert cache.keys is keys and cache.state[2:] == state[2:]


def test_lru_prompt_cache_with_quantized_entries_fetches_trims_and_counts_bytes():
    lru = LRUPromptCache(max_size=10)
    before = active()
    tokens, caches = list(range(30)), [filled(30, bits=4) for _ in range(2)]
    [c.compact() for c in caches]
    prefixes = [c.to_kv_cache() for c in caches]
    [c.trim(10) for c in prefixes]
    lru.insert_cache("m", tokens[:20], [c.to_quantized(64, 4) for c in prefixes])
    del prefixes
    lru.insert_cache("m", tokens, caches)  # its 20-token prefix is dropped
    del caches
    assert len(lru) == 1 and lru.nbytes == active() - before
    assert lru.nbytes == 2 * quantized_bytes(30, bits=4)

    longer, rest = lru.fetch_nearest_cache("m", tokens[:12] + [999])
    assert rest == [999] and [c.size() for c in longer] == [12, 12]
    shorter, rest = lru.fetch_nearest_cache("m", tokens + [7, 8])
    assert rest == [7, 8] and [c.size() for c in shorter] == [30, 30]
    exact, rest = lru.fetch_nearest_cache("m", tokens)
    assert rest == [] and exact[0].to_kv_cache().keys.shape[2] == 30
    del longer, shorter, exact
    assert lru.nbytes == active() - before
    lru.trim_to(n_bytes=0)
    assert len(lru) == 0 and lru.nbytes == 0 and active() == before


@pytest.mark.parametrize("kv_bits", [8, 4])
def test_greedy_tokens_with_kv_bits_match_upstream(kv_bits):
    model = tiny.build_model(tiny.model_config("llama", head_dim=64))
    prompt = mx.array(np.random.default_rng(3).integers(0, 512, 45))
    kw = dict(kv_bits=kv_bits, quantized_kv_start=0, prefill_step_size=16)
    patched = single_stream(model, prompt, 12, **kw)[0]
    mlx_lm_patched.revert()
    assert patched == single_stream(model, prompt, 12, **kw)[0]


@st.composite
def quantized_sessions(draw):
    group_size = draw(st.sampled_from([32, 64]))
    bits = draw(st.sampled_from([4, 8]))
    dim = draw(st.sampled_from([32, 64, 64, 80]))
    dtype = draw(st.sampled_from(["float32", "bfloat16"]))
    ops = st.one_of(
        st.tuples(st.just("update"), st.integers(1, 96)),
        st.tuples(st.just("update"), st.integers(1, 3)),
        st.tuples(st.just("trim"), st.integers(0, 64)),
        st.tuples(st.just("compact"), st.just(0)),
        st.tuples(st.just("reserve"), st.integers(0, 256)),
        st.tuples(st.just("save_load"), st.just(0)),
    )
    return group_size, bits, dim, dtype, draw(st.lists(ops, min_size=1, max_size=12))


@fuzz
@given(quantized_sessions(), st.integers(0, 2**31 - 1))
def test_quantized_cache_holds_its_tokens_within_quantization_error(session, seed):
    """A quantized cache dequantizes to exactly the tokens of a ``KVCache``
    fed the same, each quantized on its own; attention through it equals
    attention over them; its bookkeeping equals upstream's (where upstream can
    quantize the head dim) and save/load is bit-exact."""
    group_size, bits, dim, dtype, ops = session
    dtype = getattr(mx, dtype)
    mx.random.seed(seed)
    ours, plain = QuantizedKVCache(group_size=group_size, bits=bits), KVCache()
    theirs = None
    if dim % group_size == 0:
        Upstream = upstream_twin(quantized_cache.PATCH, QuantizedKVCache)
        theirs = Upstream(group_size=group_size, bits=bits)
    for op, n in ops:
        if op == "update":
            k, v = (x.astype(dtype) for x in random_kv(1, 2, n, dim))
            q = mx.random.normal((1, 4, n, dim)).astype(dtype)
            offset = ours.offset
            out = scaled_dot_product_attention(
                q, *ours.update_and_fetch(k, v), ours, 1.0, "causal"
            )
            keys, values = plain.update_and_fetch(k, v)
            dk, dv = (
                dequantized(x, group_size, bits, dim).astype(mx.float32)
                for x in (keys, values)
            )
            mask = reference_mask(offset, n, offset + n)
            q = q.astype(mx.float32)
            ref = attend(q, mx.repeat(dk, 2, 1), mx.repeat(dv, 2, 1), mask)
            # bfloat16 scores differ by rounding alone: check float32 only.
            if dtype == mx.float32:
                assert mx.allclose(out, ref, atol=1e-5).item()
            if theirs is not None:
                fetched = theirs.update_and_fetch(k, v)
                got = ours.keys_and_values()
                pairs = zip([*got[0], *got[1]], [*fetched[0], *fetched[1]])
                assert all(same(a, b) for a, b in pairs)
        elif op == "trim":
            trimmed = plain.trim(n)
            assert ours.trim(n) == trimmed
            if theirs is not None:
                assert theirs.trim(n) == trimmed
        elif op == "compact":
            ours.compact()
            assert ours.keys is None or ours.keys[0].shape[2] == ours.offset
        elif op == "reserve":
            ours.reserve(n)
        else:
            before = ours.state
            ours = save_load(ours)
            after = ours.state
            assert before[2:] == after[2:]
            if before[0] is not None:
                pairs = zip([*before[0], *before[1]], [*after[0], *after[1]])
                assert all(same(a, b) for a, b in pairs)
        assert ours.offset == ours.size() == plain.offset
        if theirs is not None:
            assert theirs.offset == ours.offset
        kv = ours.to_kv_cache()
        assert kv.offset == ours.offset
        if ours.offset:
            keys = plain.keys[..., : plain.offset, :]
            values = plain.values[..., : plain.offset, :]
            dk, dv = (dequantized(x, group_size, bits, dim) for x in (keys, values))
            assert same(kv.keys, dk) and same(kv.values, dv)
            # Half a quantization step, with room for bfloat16's rounding of
            # the scales, biases and result (8 bits of mantissa).
            rounding = 2.0**-5 if dtype == mx.bfloat16 else 0.0
            err = (2.0 ** (2 - bits) + rounding) * mx.abs(keys).max().item()
            assert mx.abs(kv.keys - keys).max().item() <= err


# The decode tail (on by default only on CUDA, where the kernel reads it; set
# here, where attention quantizes it after the packed tokens).


def tail_pair(bits, tail=8):
    """A cache with a decode tail of ``tail`` tokens and one without."""
    on, off = QuantizedKVCache(64, bits), QuantizedKVCache(64, bits)
    on.decode_tail, off.decode_tail = tail, 0
    return on, off


def as_quantized(keys, values, cache):
    """The (packed, scales, biases) of keys and values an update handed out,
    a tail's tokens quantized after the packed ones."""
    if len(keys) == 5:
        return base._quantize_tail(keys, values, cache.group_size, cache.bits)
    return keys, values


@pytest.mark.parametrize("bits", [4, 8])
def test_decode_steps_through_a_tail_hand_out_and_keep_the_same_bits(bits):
    """Steps of 1-3 tokens through a tail of 8 (full every few steps, the
    buffers grown under it) hand attention the tokens a cache without a tail
    holds, bit for bit, and leave the same state."""
    on, off = tail_pair(bits)
    k, v = kv(40, dtype=mx.bfloat16, seed=1)
    for c in (on, off):
        c.update_and_fetch(k, v)
    tails = []
    for i, n in enumerate([1, 1, 3, 1, 2, 1, 1, 1, 3, 1] * 4):
        k, v = kv(n, dtype=mx.bfloat16, seed=10 + i)
        got = on.update_and_fetch(k, v)
        want = off.update_and_fetch(k, v)
        assert len(got[0]) == 5 and len(want[0]) == 3
        assert same(as_quantized(*got, on), list(want)), i
        tails.append(on._tail_len)
    assert max(tails) <= 8 and tails.count(0) == 0 and len(set(tails)) > 4
    assert on.offset == off.offset == 40 + 60
    assert same(on.state, off.state)  # the tail quantized as it is read
    assert on._tail_len == 0


@pytest.mark.parametrize("n", [2, 9])
def test_trimming_into_and_past_the_tail_keeps_a_tailless_cache_s_tokens(n):
    """A speculative step's rejected tokens trimmed from the tail (2), or
    past it into the packed tokens (9), then new steps: the tokens and bits
    of a cache without a tail."""
    on, off = tail_pair(8)
    k, v = kv(30, dtype=mx.bfloat16, seed=2)
    for c in (on, off):
        c.update_and_fetch(k, v)
    for i in range(5):
        k, v = kv(1, dtype=mx.bfloat16, seed=20 + i)
        on.update_and_fetch(k, v)
        off.update_and_fetch(k, v)
    assert on._tail_len == 5
    assert on.trim(n) == off.trim(n) == n
    assert on._tail_len == max(0, 5 - n)
    for i in range(12):
        k, v = kv(3, dtype=mx.bfloat16, seed=40 + i)
        got, want = on.update_and_fetch(k, v), off.update_and_fetch(k, v)
        assert same(as_quantized(*got, on), list(want)), i
    assert same(on.state, off.state)


def test_a_cache_read_with_tokens_in_its_tail_reads_them_quantized():
    """State, a saved file, bytes, a dequantized copy and compaction, taken
    while tokens wait in the tail: what a cache without a tail gives (bytes:
    its buffers and the tail's)."""
    on, off = tail_pair(4)
    k, v = kv(20, dtype=mx.bfloat16, seed=3)
    for c in (on, off):
        c.update_and_fetch(k, v)

    def step(seed):
        k, v = kv(1, dtype=mx.bfloat16, seed=seed)
        on.update_and_fetch(k, v)
        off.update_and_fetch(k, v)
        assert on._tail_len

    step(4)
    assert same(save_load(on).state, save_load(off).state)
    step(5)
    assert same(on.to_kv_cache().state, off.to_kv_cache().state)
    step(6)
    packed = sum(x.nbytes for x in on.keys + on.values)
    assert on.nbytes == packed + 2 * (1 * 2 * 8 * 64 * 2)  # the tail: 8 bf16 tokens
    step(7)
    on.compact(), off.compact()
    assert same(on.state, off.state) and on.nbytes == off.nbytes


def test_no_tail_where_the_kernel_cannot_read_one():
    """A float32 cache, 6 bits, key and value dims that differ, or dims past
    128 quantize each step at once."""
    for dtype, bits, dims in [
        (mx.float32, 8, (64, 64)),
        (mx.bfloat16, 6, (64, 64)),
        (mx.bfloat16, 8, (64, 128)),
        (mx.bfloat16, 8, (256, 256)),
    ]:
        c = QuantizedKVCache(64, bits)
        c.decode_tail = 8
        k, _ = kv(10, dim=dims[0], dtype=dtype)
        _, v = kv(10, dim=dims[1], dtype=dtype)
        c.update_and_fetch(k, v)
        keys, _ = c.update_and_fetch(k[:, :, :1], v[:, :, :1])
        assert len(keys) == 3 and c._tail is None, (dtype, bits, dims)


def test_a_cache_whose_step_waits_for_its_tail_write_deep_copies():
    """A decode step's tokens not yet in the tail (no kernel wrote them):
    ``copy.deepcopy`` (upstream's prompt cache LRU) copies the cache, the
    copy's tail gets them, and the two go on apart."""
    on, off = tail_pair(8)
    k, v = kv(40, dtype=mx.bfloat16, seed=1)
    for c in (on, off):
        c.update_and_fetch(k, v)
    k, v = kv(1, dtype=mx.bfloat16, seed=2)
    for c in (on, off):
        c.update_and_fetch(k, v)
    assert on._step is not None
    twin = copy.deepcopy(on)
    assert twin._step is not None and twin._step[0].cache is twin
    k, v = kv(2, dtype=mx.bfloat16, seed=3)
    twin.update_and_fetch(k, v)
    off.update_and_fetch(k, v)
    assert same(twin.state, off.state)
    assert on.offset == 41  # the original, untouched by its copy's step
    assert same(list(on.state[0]), [x[:, :, :41] for x in off.state[0]])


def test_greedy_tokens_with_a_tail_equal_those_without(monkeypatch):
    """generate_step with --kv-bits on a bfloat16 llama: the same greedy
    tokens with a tail of 8 as without (here attention quantizes the tail)."""
    model = tiny.build_model(tiny.model_config("llama"), dtype="bfloat16")
    prompt = mx.array(np.random.default_rng(0).integers(0, 512, 60))
    kw = dict(kv_bits=4, quantized_kv_start=0, prefill_step_size=32)
    want, _ = single_stream(model, prompt, 30, **kw)
    monkeypatch.setattr(QuantizedKVCache, "decode_tail", 8)
    got, cache = single_stream(model, prompt, 30, **kw)
    assert got == want
    assert cache[0]._tail is not None
