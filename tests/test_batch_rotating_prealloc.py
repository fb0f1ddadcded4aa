"""BatchRotatingKVCache, preallocated: what each row's attention sees equals a
plain per-row window over its real tokens, through every batch operation."""

import random
import sys

import mlx.core as mx
import pytest
from fuzzing import apply_batch_op, batch_ops, chunk_sizes, fuzz, prefill_chunks
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.models.cache import (
    BatchRotatingKVCache,
    RotatingKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)
from ringref import (
    Rows,
    buffers_through,
    eval_calls,
    fake_backend,
    pipeline_calls,
    random_kv,
    same,
)

import mlx_lm_patched
from mlx_lm_patched.demo import tiny


def random_session(rng, keep=0, window=None):
    """Apply random batch operations; return the first that fails, or None.
    ``window``: the model's window_size minus ``max_size``, or None."""
    max_size = rng.choice([6, 8, 16])
    lengths = [rng.randint(0, 2 * max_size) for _ in range(rng.randint(1, 3))]
    rows = Rows(max_size, lengths, keep, None if window is None else max_size + window)
    log = [("merge", [h[0].shape[2] for h in rows.history])]
    for _ in range(rng.randint(1, 12)):
        op = rng.choice(
            ["decode"] * 4 + ["chunk", "padded", "extract", "filter", "extend"]
        )
        B = len(rows.history)
        S = rng.choice([2, 3, 5, max_size - 1, max_size, max_size + 3])
        if op == "decode":
            ok = rows.check(1)
        elif op == "chunk":
            ok = rows.check(S)
        elif op == "padded":
            lengths = [S] + [rng.randint(1, S) for _ in range(B - 1)]
            rng.shuffle(lengths)
            ok, op = rows.check(S, lengths), ("padded", lengths)
        elif op == "extract":
            ok = rows.check_extract(rng.randrange(B))
        elif op == "filter":
            ok = rows.filter(sorted(rng.sample(range(B), rng.randint(1, B)))) is None
        else:
            ok = rows.extend(rng.randint(1, 2 * max_size)) is None
        log.append(op if op not in ("chunk", "extend") else (op, S))
        if not ok:
            return max_size, log
    return None


@pytest.mark.parametrize("keep", [0, 1, 4])
@pytest.mark.parametrize("window", [None, -2, 8])
def test_every_row_sees_its_own_window_through_random_batch_operations(
    patched, keep, window
):
    """``window``: the model's window_size relative to the ring; one larger
    than the ring (a sliding layer ``max_kv_size`` shrank) is capped at it."""
    rng = random.Random(keep)
    sessions = (random_session(rng, keep, window) for _ in range(150))
    assert [f for f in sessions if f] == []


def test_upstream_rows_do_not_always_see_their_window(upstream):
    """The same sessions on upstream: right padding past the ring evicts real
    tokens, and a chunk after a wrapped decode hides a row's oldest token."""
    rng = random.Random(0)
    failures = []
    for _ in range(200):
        try:
            failures.append(random_session(rng))
        except Exception as e:  # upstream's extract of an empty batch, e.g.
            failures.append(repr(e))
    assert any(failures)


def test_a_chunk_after_wrapped_decode_keeps_the_oldest_in_window_token(patched):
    rows = Rows(8, [1, 7])  # row 0 is left-padded by 6
    assert all(rows.check(1) for _ in range(2))
    assert rows.check(3)
    mlx_lm_patched.revert()
    rows = Rows(8, [1, 7])
    assert all(rows.check(1) for _ in range(2))
    assert not rows.check(3)


@pytest.mark.parametrize(
    "chunks, lengths", [([4, 2], [2, 6]), ([2, 2, 3], [1, 7]), ([2, 2, 4], [3, 8])]
)
def test_right_padded_prefill_past_an_exactly_full_ring_keeps_short_rows_first_token(
    patched, chunks, lengths
):
    """The first chunks fill the ring of 4 exactly, the next runs past it:
    the short row's first token sits in the column attention drops, and the
    right-padding roll must bring it back."""
    rows = Rows(4, [0, 0])
    assert rows.check_prefill(chunks, lengths)
    assert rows.check_extract(0)
    assert rows.check(1) and rows.check(3) and rows.check(1)


@pytest.mark.parametrize("max_size", [1, 2, 3, 5])
def test_batch_ring_no_larger_than_keep_keeps_max_size_minus_1_first_tokens(
    patched, max_size
):
    """Rows of ``RotatingKVCache(max_size, keep=4)`` (``--max-kv-size 1`` to
    ``5``) batch like their single streams: sinks, one column or more."""
    rows = Rows(max_size, [0, 2, 7], keep=4)
    assert rows.cache.keep == min(4, max_size - 1)
    assert rows.check_prefill([3, 4], [7, 2, 5])
    assert all(rows.check(S) for S in (1, 1, 3, 1, 6, 1))
    assert all(rows.check_extract(b) for b in range(3))


@pytest.mark.parametrize("keep", [0, 4])
def test_decode_and_chunks_within_the_ring_never_reallocate(monkeypatch, keep):
    """Rows whose sinks fill during decode too (``keep`` 4, left padding 7)."""
    cache = BatchRotatingKVCache(32, left_padding=[0, 3, 7], keep=keep)
    sizes = [5, 4] + [1] * 96
    seen, concatenations = buffers_through(cache, 3, sizes, monkeypatch)
    assert concatenations == 0
    assert len(seen) == 1


@pytest.mark.parametrize("keep", [0, 4])
def test_a_chunk_past_the_ring_leaves_a_ring_of_the_same_size_without_sync(
    monkeypatch, keep
):
    """The new ring is a copy of the sinks and the newest columns, all rings
    the same size; short chunks and decode evaluate nothing."""
    cache = BatchRotatingKVCache(32, left_padding=[0, 3, 7], keep=keep)
    evals = eval_calls(monkeypatch)
    sizes = [20, 30] + [1] * 96 + [40, 5, 1, 1]
    shapes, _ = buffers_through(cache, 3, sizes, monkeypatch)
    assert {s for s, _, _ in shapes} == {(3, 2, 32, 8)}
    assert cache.nbytes == 2 * 3 * 2 * 32 * 8 * 2
    assert len(evals) == len(sizes)  # buffers_through's own, one an update


@pytest.mark.parametrize("lengths", [None, [40, 37, 30]])
def test_a_first_chunk_past_the_ring_allocates_no_ring_it_then_copies_away(
    monkeypatch, lengths
):
    """An empty ring that the first update runs past allocates only its
    sinks, attention reads the update as it is (its sinks in place, not a
    copy with the sinks ahead), and the ring it keeps is the copy of the
    sinks and the newest columns (a BatchGenerator prefill's first chunk:
    two rings a layer less in flight). Left-padded or right-padded rows."""
    cache = BatchRotatingKVCache(32, left_padding=[0, 3, 10], keep=4)
    if lengths:
        cache = BatchRotatingKVCache(32, left_padding=[0] * 3, keep=4)
        cache.prepare(lengths=lengths, right_padding=[40 - n for n in lengths])
    zeros, allocate = [], mx.zeros
    monkeypatch.setattr(mx, "zeros", lambda s, *a: zeros.append(s) or allocate(s, *a))
    keys, values = random_kv(3, 2, 40, 8)
    seen = cache.update_and_fetch(keys, values)
    assert zeros[:2] == [(3, 2, 4, 8)] * 2  # the sinks of keys and values
    assert same(seen[0], keys) and same(seen[1], values)
    assert cache.keys.shape == cache.values.shape == (3, 2, 32, 8)


def test_right_padding_is_rolled_in_one_copy_per_run_of_rows_rolled_alike(
    monkeypatch,
):
    """A right-padded chunk past the ring copies rows rolled alike together
    (rows 0-1 roll 0, rows 2-3 roll 3: two runs, one slice each for keys and
    for values past the sinks); ``finalize`` then has nothing left to roll
    and keeps the ring as it is."""
    cache = BatchRotatingKVCache(8, left_padding=[0] * 4, keep=2)
    cache.prepare(lengths=[12, 12, 9, 9], right_padding=[0, 0, 3, 3])
    helpers = sys.modules["mlx_lm.models.batch_ring_buffer"]  # _rolled_ring's
    puts, put = [], helpers._put
    monkeypatch.setattr(
        helpers, "_put", lambda b, u, *a: puts.append(u.shape) or put(b, u, *a)
    )
    cache.update_and_fetch(*random_kv(4, 2, 12, 8))
    rows = sorted(shape[0] for shape in puts if shape[2] != cache.keep)
    assert rows == [2, 2, 2, 2]
    keys, values = cache.keys, cache.values
    cache.finalize()
    assert cache.keys is keys and cache.values is values
    assert cache.offset.tolist() == [12, 12, 9, 9]
    assert cache.left_padding.tolist() == [-6, -6, -3, -3]


def test_negative_trim_raises_and_trim_never_makes_an_offset_negative():
    cache = BatchRotatingKVCache(16, left_padding=[4, 0])
    cache.update_and_fetch(*random_kv(2, 1, 6, 4))
    with pytest.raises(ValueError, match="-2"):
        cache.trim(-2)
    assert cache.offset.tolist() == [2, 6]
    assert cache.trim(4) == 4
    assert cache.offset.tolist() == [0, 2]
    assert cache.left_padding.tolist() == [2, 0]


def test_wrapped_batch_ring_saves_loads_and_continues(tmp_path):
    rows = Rows(8, [8, 3])
    for _ in range(5):
        assert rows.check(1)
    save_prompt_cache(str(tmp_path / "b.safetensors"), [rows.cache])
    (rows.cache,) = load_prompt_cache(str(tmp_path / "b.safetensors"))
    assert rows.check(1) and rows.check(3) and rows.check(1)


def test_an_update_with_another_batch_size_raises_and_changes_nothing():
    cache = BatchRotatingKVCache(16, left_padding=[0, 0])
    cache.update_and_fetch(*random_kv(2, 2, 3, 8))
    with pytest.raises(ValueError, match="BatchRotatingKVCache holds"):
        cache.update_and_fetch(*random_kv(3, 2, 1, 8))
    assert cache._offset == 3 and cache.offset.tolist() == [3, 3]


# End to end: batch_generate on mlx-lm's models.


def random_prompt(n):
    # Fixed, whatever ran before: batched rows attend through masks and
    # padding, so a prompt whose logits nearly tie could flip a row by an ulp.
    return mx.random.randint(0, 512, (n,), key=mx.random.key(n)).tolist()


def test_batch_generate_matches_upstream_and_single_streams(load_tiny, patched):
    """gemma3_text's sliding layers (window 64) batch as BatchRotatingKVCache."""
    model, tokenizer = load_tiny("gemma3_text")
    prompts = [random_prompt(n) for n in (40, 150, 300)]

    def run():
        result = batch_generate(
            model,
            tokenizer,
            prompts,
            max_tokens=100,
            return_token_ids=True,
        )
        return result.token_ids

    mlx_lm_patched.revert()
    theirs = run()
    mlx_lm_patched.apply()
    ours = run()
    singles = []
    for p in prompts:
        steps = generate_step(mx.array(p), model, prompt_cache=make_prompt_cache(model))
        singles.append([int(t) for (t, _), _ in zip(steps, range(100))])
    assert ours == theirs == singles


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


@pytest.mark.parametrize("name", ["cpu", "cuda", "metal"])
def test_a_forward_pass_of_a_batch_ring_with_short_chunks_has_no_sync(
    monkeypatch, name
):
    """Every ``mx.eval`` of whole model calls: left padding, then right
    padding (``prepare``), chunks (under 256 tokens) past the ring, then
    decode with sinks; ``finalize`` evaluates nothing."""
    fake_backend(monkeypatch, name)
    config = tiny.model_config("llama", head_dim=64, hidden_size=128)
    model = tiny.build_model(config, dtype="bfloat16")
    left = [BatchRotatingKVCache(64, [0, 5], keep=4) for _ in model.layers]
    right = [BatchRotatingKVCache(64, [0, 0], keep=4) for _ in model.layers]
    for c in right:
        c.prepare(lengths=[148, 120], right_padding=[0, 28])
    evals = eval_calls(monkeypatch)
    for cache, sizes in ((left, (48, 48, 100, 1, 1)), (right, (48, 48, 52))):
        for n in sizes:
            mx.eval(model(mx.arange(2 * n).reshape(2, n) % 512, cache=cache))
    for c in right:
        c.finalize()
    assert len(evals) == 8


@pytest.mark.parametrize("right_padding", [False, True])
def test_a_batch_ring_pipelines_long_chunks(monkeypatch, right_padding):
    """Each layer's update of a long chunk, within the ring and past it, is
    scheduled, then waits for the previous layer's one-element marker."""
    config = tiny.model_config("llama", head_dim=64, hidden_size=128)
    model = tiny.build_model(config, dtype="bfloat16")
    L = len(model.layers)
    cache = [BatchRotatingKVCache(512, [0, 5], keep=4) for _ in model.layers]
    if right_padding:
        cache = [BatchRotatingKVCache(512, [0, 0], keep=4) for _ in model.layers]
        for c in cache:
            c.prepare(lengths=[600, 595], right_padding=[0, 5])
    calls = pipeline_calls(monkeypatch)
    for n in (300, 300):  # within the ring, past it
        model(mx.arange(2 * n).reshape(2, n) % 512, cache=cache)
    scheduled = [len(s) for name, s in calls if name == "async_eval"]
    assert scheduled == [3] * L + [5] * L  # the ring (+ what attention sees)
    assert [name for name, _ in calls] == ["async_eval"] + ["async_eval", "eval"] * (
        2 * L - 1
    )
    assert all(s == [(1, 1, 1, 1)] for name, s in calls if name == "eval")


def test_right_padding_rolls_rings_by_copies_not_gathers(monkeypatch):
    """The rolls are known on the host: the new rings are slices written in
    place, not gathered (MLX's CUDA gather is slow); only the sinks (2
    columns) are taken along an index."""
    columns, take = [], mx.take_along_axis
    monkeypatch.setattr(
        mx,
        "take_along_axis",
        lambda a, i, axis: columns.append(i.shape[2]) or take(a, i, axis),
    )
    rows = Rows(8, [0, 0], keep=2)
    assert rows.check_prefill([6, 4], [10, 3])  # past the ring, then finalize
    assert rows.check(1) and rows.check(3)
    assert columns and set(columns) == {2}


def test_updates_write_sinks_only_while_a_row_lacks_keep_tokens(monkeypatch):
    """Known without a sync: merged rows, right padding (counted at
    ``finalize``), decode; the rows' sinks hold their first tokens."""
    calls, update = [], BatchRotatingKVCache._update_sinks
    monkeypatch.setattr(
        BatchRotatingKVCache,
        "_update_sinks",
        lambda *a: calls.append(a[1].shape[2]) or update(*a),
    )
    rows = Rows(32, [0, 3, 7], keep=4)  # row 0: no token yet
    assert all(rows.check(S) for S in (2, 1, 1, 1, 1))
    assert calls == [2, 1, 1]
    calls.clear()
    rows = Rows(32, [0, 0], keep=4)
    assert rows.check_prefill([6, 4], [10, 3])  # finalize: 3 real tokens
    assert all(rows.check(S) for S in (1, 1, 1))
    assert calls == [6, 4, 1]


def test_nbytes_counts_the_undo_ring_rows_bring_with_their_slack():
    """A batch of rows with slack keeps an undo ring once it wraps; the
    server's prompt cache budgets by ``nbytes``, so it counts that too."""
    rows = []
    for n in (5, 9):
        row = RotatingKVCache(8, keep=2, slack=2)
        row.update_and_fetch(*random_kv(1, 2, n, 4))
        rows.append(row)
    batch = BatchRotatingKVCache.merge(rows)
    for _ in range(12):
        batch.update_and_fetch(*random_kv(2, 2, 1, 4))
    assert batch._undo_keys is not None
    held = (batch.keys, batch.values, batch._undo_keys, batch._undo_values)
    assert batch.nbytes == sum(x.nbytes for x in held)
    assert BatchRotatingKVCache(8, left_padding=[0]).nbytes == 0
