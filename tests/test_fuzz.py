"""Differential fuzzing of the patched caches with hypothesis.

Each example is a random sequence of operations on one cache, checked after
every step against a plain reference (every token kept, the mask attention
must apply) and, where upstream is correct, against upstream run side by side.
CI runs a few examples per test; ``make fuzz`` runs
``MLX_LM_PATCHED_FUZZ_EXAMPLES`` (10,000) per test.
"""

import itertools
import os

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
)
from ringref import attend, random_kv, reference_mask, save_load, upstream_twin
from test_batch_rotating_prealloc import Rows

from mlx_lm_patched import quantized_cache, rotating_prealloc

pytestmark = pytest.mark.usefixtures("patched")

EXAMPLES = int(os.environ.get("MLX_LM_PATCHED_FUZZ_EXAMPLES", "100"))
fuzz = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)


def same(a, b):
    if isinstance(a, mx.array) and isinstance(b, mx.array):
        return a.shape == b.shape and mx.array_equal(a, b).item()
    return type(a) is type(b) and a == b


# RotatingKVCache


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


@fuzz
@given(ring_sessions(), st.integers(0, 2**31 - 1))
def test_ring_attention_equals_reference_and_upstream_when_keep_is_zero(session, seed):
    """Ours sees what an unbounded cache with a keep-and-window mask sees
    (the window capped at the ring); with ``keep=0`` and a window no larger
    than the ring upstream returns the very same arrays and masks."""
    max_size, keep, window, ops = session
    mx.random.seed(seed)
    ours = RotatingKVCache(max_size, keep)
    theirs = None
    if keep == 0 and (window or max_size) <= max_size:
        theirs = upstream_twin(rotating_prealloc.PATCH, RotatingKVCache)(max_size)
    hk, hv = random_kv(1, 2, 0, 4)
    for op, n in ops:
        if op == "trim":
            if not ours.is_trimmable():
                continue
            assert ours.trim(n) == min(n, hk.shape[2])
            if theirs is not None:
                assert theirs.trim(n) == min(n, hk.shape[2])
            hk, hv = hk[..., : ours.offset, :], hv[..., : ours.offset, :]
        elif op == "save_load":
            ours = save_load(ours)
            if theirs is not None:
                theirs = type(theirs).from_state(theirs.state)
        else:
            k, v = random_kv(1, 2, n, 4)
            q = mx.random.normal((1, 2, n, 4))
            offset = ours.offset
            mask = ours.make_mask(n, window_size=window)
            # Snapshot: the next update writes into the returned ring.
            got = [mx.array(x) for x in ours.update_and_fetch(k, v)]
            hk = mx.concatenate([hk, k], axis=2)
            hv = mx.concatenate([hv, v], axis=2)
            ref_mask = reference_mask(
                offset, n, min(window or max_size, max_size), keep
            )
            ref = attend(q, hk, hv, ref_mask)
            assert mx.allclose(attend(q, *got, mask), ref, atol=1e-5).item()
            if theirs is not None:
                assert same(theirs.make_mask(n, window_size=window), mask)
                fetched = theirs.update_and_fetch(k, v)
                assert all(same(a, b) for a, b in zip(got, fetched))
        assert ours.offset == hk.shape[2]
        assert ours.size() == min(ours.offset, max_size)
        if theirs is not None:
            assert theirs.offset == ours.offset


# BatchRotatingKVCache, through the ``Rows`` harness


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


@st.composite
def batch_sessions(draw):
    max_size = draw(st.sampled_from([2, 3, 4, 6, 8, 16]))
    keep = draw(st.sampled_from([k for k in (0, 0, 1, 2, 4) if k < max_size]))
    lengths = draw(st.lists(st.integers(0, 2 * max_size), min_size=1, max_size=3))
    ops = draw(st.lists(batch_ops(max_size), min_size=1, max_size=12))
    if draw(st.booleans()):
        # As BatchGenerator starts new prompts: an empty batch, right-padded.
        lengths = [0] * draw(st.integers(2, 3))
        ops.insert(0, ("prefill", draw(prefill_chunks(chunk_sizes(max_size)))))
    return max_size, keep, lengths, ops


@fuzz
@given(batch_sessions(), st.integers(0, 2**31 - 1), st.randoms(use_true_random=False))
def test_every_batch_row_sees_its_own_window_through_random_operations(
    session, seed, rng
):
    """Merge singles (with or without keep), then decode, chunks, right-padded
    chunks, right-padded prefills in several chunks, extract, filter, extend
    and save/load in any order: every real query of every row attends to
    exactly its reference window."""
    max_size, keep, lengths, ops = session
    mx.random.seed(seed)
    rows = Rows(max_size, lengths, keep)
    for op, n in ops:
        assert apply_batch_op(rows, op, n, rng)
        assert rows.cache.offset.tolist() == [h[0].shape[2] for h in rows.history]
        # What each row holds now, as its next decode step would see it.
        assert all(rows.check_extract(b) for b in range(rows.B))


# QuantizedKVCache


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


def dequantized(x, group_size, bits, dim):
    """``x`` as a quantized cache of that layout must give it back."""
    g, width, _ = quantized_cache._kv_quant_layout(dim, dim, group_size, bits)
    if width > dim:
        x = mx.pad(x, [(0, 0), (0, 0), (0, 0), (0, width - dim)])
    x = mx.dequantize(*mx.quantize(x, group_size=g, bits=bits), group_size=g, bits=bits)
    return x[..., :dim]


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
