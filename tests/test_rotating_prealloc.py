"""RotatingKVCache, preallocated: same answers as upstream, one buffer, fixed defects."""

import random
import sys

import mlx.core as mx
import pytest
from fuzzing import fuzz, ring_sessions
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (
    KVCache,
    RotatingKVCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)
from ringref import (
    attend,
    buffers_through,
    data_pointer,
    eval_calls,
    fake_backend,
    pipeline_calls,
    random_kv,
    reference_mask,
    same,
    save_load,
    upstream_twin,
)

import mlx_lm_patched
from mlx_lm_patched.caches import rotating_prealloc
from mlx_lm_patched.demo import tiny


@pytest.fixture
def Upstream(patched):
    return upstream_twin(rotating_prealloc.PATCH, RotatingKVCache)


def random_updates(rng, max_size):
    sizes = [1, 1, 1, 2, 3, 5, max_size - 1, max_size, 2 * max_size + 1]
    return [rng.choice(sizes) or 1 for _ in range(rng.randint(1, 14))]


def feed(cache, sizes, window=None):
    """Update ``cache`` with random chunks; yield (offset, S, mask, keys, values, k, v)."""
    for S in sizes:
        k, v = random_kv(1, 1, S, 4)
        offset = cache.offset
        mask = cache.make_mask(S, window_size=window)
        yield offset, S, mask, *cache.update_and_fetch(k, v), k, v


def continue_with(cache, chunks):
    """Masks and arrays attention sees over ``chunks``, snapshotted."""
    out = []
    for k, v in chunks:
        mask = cache.make_mask(k.shape[2])
        out.append((mask, *[mx.array(x) for x in cache.update_and_fetch(k, v)]))
    return out


def test_attention_sees_the_same_arrays_as_upstream_when_keep_is_zero(Upstream):
    rng = random.Random(0)
    for _ in range(150):
        max_size = rng.choice([4, 8, 16])
        window = rng.choice([None, max_size - 2])
        ours, theirs = RotatingKVCache(max_size), Upstream(max_size)
        for S in random_updates(rng, max_size):
            k, v = random_kv(1, 2, S, 4)
            masks = [c.make_mask(S, window_size=window) for c in (ours, theirs)]
            # Snapshot: a returned buffer is mutated by the next update.
            got = [
                [mx.array(x) for x in c.update_and_fetch(k, v)] for c in (ours, theirs)
            ]
            assert same(*masks)
            assert all(same(a, b) for a, b in zip(*got))


def check_against_reference(max_size, keep, window, sizes):
    cache, seen_k, seen_v = RotatingKVCache(max_size, keep), [], []
    # The newest token needs a slot: at most ``max_size - 1`` first tokens stay.
    keep, visible = min(keep, max_size - 1), min(window or max_size, max_size)
    for offset, S, mask, keys, values, k, v in feed(cache, sizes, window):
        q = mx.random.normal((1, 1, S, 4))
        seen_k.append(k), seen_v.append(v)
        ref = attend(
            q,
            mx.concatenate(seen_k, axis=2),
            mx.concatenate(seen_v, axis=2),
            reference_mask(offset, S, visible, keep),
        )
        if not mx.allclose(attend(q, keys, values, mask), ref, atol=1e-5).item():
            return False
    return True


@pytest.mark.parametrize("keep", [0, 1, 3])
def test_attention_equals_an_unbounded_cache_with_a_keep_and_window_mask(keep):
    rng = random.Random(keep)
    for _ in range(100):
        max_size = rng.choice([8, 16])
        window = rng.choice([None, max_size - 2])
        assert check_against_reference(
            max_size, keep, window, random_updates(rng, max_size)
        )


@pytest.mark.parametrize("keep", [0, 3])
def test_a_window_larger_than_the_ring_is_capped_at_the_ring_in_every_mask(keep):
    """A sliding layer shrunk below the model's window by ``max_kv_size``:
    chunks, decode and chunks past the ring all see ``max_size`` tokens, so
    the chunking does not change what attention sees."""
    rng = random.Random(keep)
    for _ in range(60):
        assert check_against_reference(16, keep, 24, random_updates(rng, 16))
    assert check_against_reference(16, keep, 24, [40])
    assert check_against_reference(16, keep, 24, [20, 20])


@pytest.mark.parametrize("max_size, keep", [(1, 4), (3, 4), (4, 4), (5, 4)])
def test_a_ring_no_larger_than_keep_keeps_max_size_minus_1_first_tokens(max_size, keep):
    """``--max-kv-size 1`` or ``3`` gives ``RotatingKVCache(max_size, keep=4)``:
    every query sees itself, the first ``max_size - 1`` tokens and nothing
    else, whether the prompt comes in chunks or token by token."""
    assert RotatingKVCache(max_size, keep).keep == min(keep, max_size - 1)
    rng = random.Random(max_size)
    for _ in range(40):
        sizes = random_updates(rng, max_size)
        assert check_against_reference(max_size, keep, None, sizes)


def test_upstream_ring_no_larger_than_keep_never_holds_the_newest_token(upstream):
    cache = RotatingKVCache(3, keep=4)
    cache.update_and_fetch(*random_kv(1, 1, 10, 4))
    new = mx.full((1, 1, 1, 4), 7.0)
    keys, _ = cache.update_and_fetch(new, new)
    assert keys.shape[2] == 4 and not (keys == 7.0).all(axis=-1).any().item()


@pytest.mark.parametrize("cls", ["RotatingKVCache", "BatchRotatingKVCache"])
def test_a_ring_of_no_slots_raises(cls):
    from mlx_lm.models import cache

    args = (0,) if cls == "RotatingKVCache" else (0, [0])
    with pytest.raises(ValueError, match=f"{cls}: max_size must be >= 1, got 0"):
        getattr(cache, cls)(*args)


def test_upstream_hides_keep_tokens_from_a_chunk_past_the_ring(upstream):
    # max_size=8, keep=2, one 12-token prefill: query 9 must see 0, 1, 4..9.
    assert not check_against_reference(8, 2, None, [12])


def test_upstream_rolls_the_decode_mask_as_if_keep_were_zero(upstream):
    assert not check_against_reference(16, 3, 14, [1] * 40)


@pytest.mark.parametrize("keep", [0, 4])
def test_decode_and_chunks_within_the_ring_never_reallocate(monkeypatch, keep):
    max_size = 64
    cache = RotatingKVCache(max_size, keep=keep)
    sizes = [30, 30, 4] + [1] * (3 * max_size)
    seen, concatenations = buffers_through(cache, 1, sizes, monkeypatch)
    assert concatenations == 0
    assert len(seen) == 1


@pytest.mark.parametrize("keep", [0, 4])
def test_a_chunk_past_the_ring_leaves_a_ring_of_the_same_size_without_sync(
    monkeypatch, keep
):
    """The chunk's new ring is a copy of the newest tokens: writing into the
    old one in place would need a sync (its readers first)."""
    max_size = 64
    cache = RotatingKVCache(max_size, keep=keep)
    evals = eval_calls(monkeypatch)
    sizes = [64, 30, 30, 40] + [1] * (3 * max_size) + [50, 17, 1, 1, 64, 100]
    shapes, _ = buffers_through(cache, 1, sizes, monkeypatch)
    assert {s for s, _, _ in shapes} == {(1, 2, max_size, 8)}
    assert cache.nbytes == 2 * 2 * max_size * 8 * 2
    assert len(evals) == len(sizes)  # buffers_through's own, one an update


@pytest.mark.parametrize("name", ["cpu", "cuda", "metal"])
def test_a_forward_pass_of_short_chunks_past_the_ring_has_no_sync(monkeypatch, name):
    """Every ``mx.eval`` of a whole model call, chunks (under 256 tokens)
    past the ring, then decode, on each backend's attention road."""
    fake_backend(monkeypatch, name)
    config = tiny.model_config("llama", head_dim=64, hidden_size=128)
    model = tiny.build_model(config, dtype="bfloat16")
    cache = [RotatingKVCache(64, keep=4) for _ in model.layers]
    evals = eval_calls(monkeypatch)
    for n in (48, 48, 100, 1, 1):
        mx.eval(model(mx.arange(n)[None] % 512, cache=cache))
    assert len(evals) == 5


def test_long_chunks_are_pipelined_a_layer_at_a_time(monkeypatch):
    """Each layer's update of a long chunk is scheduled, then waits for the
    previous layer's one-element marker, never for its own; shorter chunks
    and decode evaluate nothing."""
    config = tiny.model_config("llama", head_dim=64, hidden_size=128)
    model = tiny.build_model(config, dtype="bfloat16")
    L, H = len(model.layers), config["num_key_value_heads"]
    cache = [RotatingKVCache(512, keep=4) for _ in model.layers]
    calls = pipeline_calls(monkeypatch)
    for n in (300, 300, 255, 1):  # within the ring, past it, past it, decode
        model(mx.arange(n)[None] % 512, cache=cache)
    ring, seen, marker = (1, H, 512, 64), (1, H, 300 + 300, 64), (1, 1, 1, 1)
    scheduled = [s for name, s in calls if name == "async_eval"]
    assert (
        scheduled == [[ring, ring, marker]] * L + [[seen, seen, ring, ring, marker]] * L
    )
    assert [name for name, _ in calls] == ["async_eval"] + ["async_eval", "eval"] * (
        2 * L - 1
    )
    assert all(s == [marker] for name, s in calls if name == "eval")


def test_a_pipelined_chunk_past_the_ring_holds_fewer_layers_in_flight(monkeypatch):
    """Unpipelined, MLX copies every layer's ring last and holds every
    layer's transient until then; pipelined, a layer or two at a time."""
    config = tiny.model_config(
        "llama",
        num_hidden_layers=8,
        hidden_size=256,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=256,
        head_dim=32,
    )
    model = tiny.build_model(config, dtype="bfloat16")
    cache_module = sys.modules["mlx_lm.models.cache"]
    monkeypatch.setattr(sys.modules["mlx_lm.models.ring_buffer"], "PIPELINE_MIN", 256)

    def peak():
        cache = [RotatingKVCache(256, keep=4) for _ in model.layers]
        mx.eval(model(mx.arange(256)[None] % 512, cache=cache))
        mx.synchronize()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        mx.eval(model(mx.arange(256)[None] % 512, cache=cache))  # past the ring
        return mx.get_peak_memory() - before

    pipelined = peak()
    monkeypatch.setattr(cache_module, "_pipeline", lambda arrays, chunk: None)
    in_flight = peak()
    layer_seen = 2 * 8 * (255 + 256) * 32 * 2  # keys and values, bfloat16
    assert pipelined < in_flight - 2 * layer_seen


def test_under_compile_a_long_chunk_is_not_pipelined():
    """``mx.compile`` cannot evaluate inside its graph: the same output."""
    config = tiny.model_config("llama", head_dim=64, hidden_size=128)
    model = tiny.build_model(config, dtype="bfloat16")

    def forward(tokens):
        cache = [RotatingKVCache(256, keep=4) for _ in model.layers]
        model(tokens[:, :300], cache=cache)
        return model(tokens[:, 300:], cache=cache)

    tokens = mx.arange(600)[None] % 512
    assert same(mx.compile(forward)(tokens), forward(tokens))


@pytest.mark.parametrize("keep", [0, 4])
def test_a_first_chunk_past_the_ring_is_attended_as_it_is(keep):
    """Nothing held yet: attention reads the update itself, not a copy of
    it, and the ring keeps a copy of its sinks and newest tokens."""
    cache = RotatingKVCache(32, keep=keep)
    keys, values = random_kv(1, 2, 40, 8)
    seen = cache.update_and_fetch(keys, values)
    assert seen[0] is keys and seen[1] is values
    newest = slice(40 - 32 + keep, 40)
    assert same(cache.keys[..., keep:, :], keys[..., newest, :])
    assert same(cache.keys[..., :keep, :], keys[..., :keep, :])


def test_nbytes_is_the_ring_from_the_first_update_on():
    cache = RotatingKVCache(32)
    assert cache.nbytes == 0
    for _ in range(70):
        cache.update_and_fetch(*random_kv(1, 2, 1, 8))
        assert cache.nbytes == 2 * (2 * 32 * 8 * 4)


def test_negative_trim_raises_and_changes_nothing():
    cache = RotatingKVCache(16)
    cache.update_and_fetch(*random_kv(1, 1, 5, 4))
    with pytest.raises(ValueError, match="RotatingKVCache.trim.*-1"):
        cache.trim(-1)
    assert (cache.offset, cache._idx, cache.size()) == (5, 5, 5)


def test_trim_of_a_wrapped_ring_raises_and_changes_nothing():
    cache = RotatingKVCache(8)
    for _ in range(11):
        cache.update_and_fetch(*random_kv(1, 1, 1, 4))
    before = (cache.offset, cache._idx, mx.array(cache.keys))
    assert not cache.is_trimmable()
    with pytest.raises(ValueError, match="wrapped"):
        cache.trim(2)
    assert (cache.offset, cache._idx) == before[:2]
    assert mx.array_equal(cache.keys, before[2]).item()


def test_trimmed_ring_continues_like_one_that_never_saw_the_trimmed_tokens():
    rng = random.Random(3)
    for _ in range(30):
        k, v = random_kv(1, 1, 12, 4)
        trimmed, plain = RotatingKVCache(16, 2), RotatingKVCache(16, 2)
        trimmed.update_and_fetch(k, v)
        assert trimmed.trim(rng.randint(0, 20)) <= 12
        n = trimmed.offset
        if n:
            plain.update_and_fetch(k[..., :n, :], v[..., :n, :])
        chunks = [random_kv(1, 1, S, 4) for S in random_updates(rng, 16)]
        for want, got in zip(
            continue_with(plain, chunks), continue_with(trimmed, chunks)
        ):
            assert all(same(a, b) for a, b in zip(want, got))


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((2, 2, 1, 8), mx.float32),
        ((1, 3, 1, 8), mx.float32),
        ((1, 2, 1, 16), mx.float32),
        ((1, 2, 1, 8), mx.float16),
    ],
)
def test_an_update_that_does_not_fit_the_ring_raises_and_changes_nothing(shape, dtype):
    cache = RotatingKVCache(16)
    cache.update_and_fetch(*random_kv(1, 2, 3, 8))
    before = mx.array(cache.keys)
    k, v = random_kv(*shape)
    with pytest.raises(ValueError, match="RotatingKVCache holds"):
        cache.update_and_fetch(k.astype(dtype), v.astype(dtype))
    assert cache.offset == 3 and mx.array_equal(cache.keys, before).item()


def test_a_state_set_on_a_decoding_ring_is_checked_at_its_next_step():
    cache = RotatingKVCache(16)
    for S in (3, 1):  # decoding: a step is checked against the last one's shapes
        cache.update_and_fetch(*random_kv(1, 1, S, 8))
    other = RotatingKVCache(16)
    other.update_and_fetch(*random_kv(1, 2, 3, 8))
    cache.state = other.state
    # One head would broadcast into the two the ring now holds.
    with pytest.raises(ValueError, match="RotatingKVCache holds"):
        cache.update_and_fetch(*random_kv(1, 1, 1, 8))
    assert cache.offset == 3 and mx.array_equal(cache.keys, other.state[0]).item()


@pytest.mark.parametrize("updates", [[5], [20], [20, 1, 1, 3], [6, 1, 1]])
def test_saved_ring_loads_and_continues_like_the_original(tmp_path, updates):
    ours = RotatingKVCache(16, keep=2)
    for S in updates:
        ours.update_and_fetch(*random_kv(1, 2, S, 4))
    save_prompt_cache(str(tmp_path / "c.safetensors"), [ours])
    (loaded,) = load_prompt_cache(str(tmp_path / "c.safetensors"))
    chunks = [random_kv(1, 2, S, 4) for S in [1, 3, 1, 20, 1]]
    for want, got in zip(continue_with(ours, chunks), continue_with(loaded, chunks)):
        assert all(same(a, b) for a, b in zip(want, got))
    assert loaded.nbytes == ours.nbytes


@pytest.mark.parametrize("updates", [[5], [20], [20, 1, 1, 3], [300, 1]])
def test_a_file_saved_by_upstream_continues_like_upstream(tmp_path, upstream, updates):
    theirs = RotatingKVCache(16)
    for S in updates:
        theirs.update_and_fetch(*random_kv(1, 2, S, 4))
    save_prompt_cache(str(tmp_path / "c.safetensors"), [theirs])
    chunks = [random_kv(1, 2, S, 4) for S in [1, 3, 1, 20, 1]]
    expected = continue_with(theirs, chunks)
    mlx_lm_patched.apply()
    (ours,) = load_prompt_cache(str(tmp_path / "c.safetensors"))
    for want, got in zip(expected, continue_with(ours, chunks)):
        assert all(same(a, b) for a, b in zip(want, got))


# End to end: greedy tokens of mlx-lm's own models.


def greedy(model, prompt, cache, n, prefill_step_size=256):
    steps = generate_step(
        mx.array(prompt),
        model,
        prompt_cache=cache,
        max_tokens=n,
        prefill_step_size=prefill_step_size,
    )
    return [int(t) for t, _ in steps]


def random_prompt(n, seed=1):
    return mx.random.randint(0, 512, (n,), key=mx.random.key(seed)).tolist()


def upstream_and_ours(run):
    mlx_lm_patched.revert()
    theirs = run()
    mlx_lm_patched.apply()
    return theirs, run()


def test_llama_ring_of_512_generates_the_same_tokens_as_upstream(load_tiny, patched):
    model, _ = load_tiny("llama")
    prompt = random_prompt(700)

    def run():
        cache = [RotatingKVCache(512) for _ in model.layers]
        first = greedy(model, prompt, cache, 2000)
        return first, greedy(model, random_prompt(300, 2), cache, 100)

    theirs, ours = upstream_and_ours(run)
    assert len(ours[0]) == 2000 and ours == theirs


def test_gemma3_sliding_layers_generate_the_same_tokens_as_upstream(load_tiny, patched):
    model, _ = load_tiny("gemma3_text", sliding_window=512)
    prompt = random_prompt(700)
    theirs, ours = upstream_and_ours(
        lambda: greedy(model, prompt, make_prompt_cache(model), 700)
    )
    assert ours == theirs


class WindowReference(KVCache):
    """An unbounded cache whose mask admits what a ring with ``keep`` should."""

    def __init__(self, max_size, keep):
        super().__init__()
        self.max_size, self.keep = max_size, keep

    def make_mask(self, N, window_size=None, return_array=False):
        return reference_mask(self.offset, N, window_size or self.max_size, self.keep)


def test_keep_ring_matches_the_reference_where_upstream_does_not(load_tiny, patched):
    """``generate --max-kv-size`` uses keep=4: upstream's chunked prefill hides
    the keep tokens; ours equals an unbounded cache with the keep/window mask,
    and prefilling in chunks equals feeding token by token."""
    model, _ = load_tiny("llama")
    prompt = random_prompt(400)

    def ring():
        return [RotatingKVCache(128, keep=4) for _ in model.layers]

    reference = greedy(
        model, prompt, [WindowReference(128, 4) for _ in model.layers], 200
    )
    ours = greedy(model, prompt, ring(), 200, prefill_step_size=96)
    one_by_one = greedy(model, prompt, ring(), 200, prefill_step_size=1)
    mlx_lm_patched.revert()
    theirs = greedy(model, prompt, ring(), 200, prefill_step_size=96)
    assert ours == reference == one_by_one
    assert theirs != reference


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


# Slack: trims after a wrap, put back from the undo ring.


def slack_session(rng, max_size, keep, slack, steps=30):
    """Random updates and trims of a ring with ``slack``; every update's
    attention is checked against the reference over the tokens still there.
    Returns how many wrapped trims were done and how many raised."""
    cache = RotatingKVCache(max_size, keep=keep, slack=slack)
    seen_k, seen_v, done, refused = [], [], 0, 0
    for _ in range(steps):
        if rng.random() < 0.35:
            n, wrapped = rng.randint(0, slack + 2), cache.offset > max_size
            if n > cache.trimmable_tokens() and wrapped:
                before = (cache.offset, cache._idx, mx.array(cache.keys))
                with pytest.raises(ValueError, match="slack"):
                    cache.trim(n)
                assert (cache.offset, cache._idx) == before[:2]
                assert same(cache.keys, before[2])
                refused += 1
                continue
            n = cache.trim(n)
            done += wrapped and n > 0
            seen_k, seen_v = seen_k[: cache.offset], seen_v[: cache.offset]
            continue
        S = rng.choice([1, 1, 1, 2, 3, 5, max_size + 3])
        k, v = random_kv(1, 1, S, 4)
        offset, mask = cache.offset, cache.make_mask(S)
        keys, values = cache.update_and_fetch(k, v)
        seen_k += list(mx.split(k, S, axis=2))
        seen_v += list(mx.split(v, S, axis=2))
        q = mx.random.normal((1, 1, S, 4))
        ref = attend(
            q,
            mx.concatenate(seen_k, axis=2),
            mx.concatenate(seen_v, axis=2),
            reference_mask(offset, S, max_size, min(keep, max_size - 1)),
        )
        assert mx.allclose(attend(q, keys, values, mask), ref, atol=1e-5).item()
    return done, refused


def test_trims_within_slack_after_a_wrap_are_exact_and_beyond_it_raise():
    rng, done, refused = random.Random(0), 0, 0
    for _ in range(60):
        max_size = rng.randint(2, 12)
        keep = rng.randint(0, min(4, max_size - 1))
        d, r = slack_session(rng, max_size, keep, rng.randint(0, max_size - keep))
        done, refused = done + d, refused + r
    assert done > 30 and refused > 10  # the session exercised both


def test_a_ring_with_slack_decodes_in_place():
    cache = RotatingKVCache(64, keep=4, slack=8)
    cache.update_and_fetch(*random_kv(1, 2, 70, 8))
    mx.eval(cache.keys, cache.values)
    pointers = set()
    for _ in range(40):
        keys, values = cache.update_and_fetch(*random_kv(1, 2, 1, 8))
        mx.eval(keys.sum() + values.sum())
        pointers.add((data_pointer(cache.keys), data_pointer(cache.values)))
    assert len(pointers) == 1 and cache.trimmable_tokens() >= 8


def test_a_wrapped_rings_undo_copies_are_slices_not_index_arrays():
    """Filling the undo ring and a trim putting its tokens back copy runs of
    consecutive columns as slices: an index array a copy made a dozen graph
    nodes a layer, which a prompt-cache hit's first step evaluated (2,328
    nodes against 536 without an undo ring, a 32-layer Gemma-3)."""
    import io
    import re

    def primitives(*arrays):
        dot = io.StringIO()
        mx.export_to_dot(dot, *arrays)
        return set(re.findall(r'label ="([A-Za-z]+)', dot.getvalue()))

    cache = RotatingKVCache(64, keep=4, slack=8)
    cache.update_and_fetch(*random_kv(1, 2, 70, 8))
    mx.eval(cache.keys, cache.values)
    keys, values = cache.update_and_fetch(*random_kv(1, 2, 1, 8))  # holds
    held = primitives(cache._undo_keys, cache._undo_values)
    mx.eval(keys, values, cache._undo_keys, cache._undo_values)
    before = [mx.array(x) for x in (cache.keys, cache.values)]
    assert cache.trim(3) == 3
    put_back = primitives(cache.keys, cache.values)
    assert "SliceUpdate" in held and "SliceUpdate" in put_back
    assert not (held | put_back) & {"Gather", "Scatter", "Arange"}
    assert not all(
        mx.array_equal(a, b).item() for a, b in zip(before, (cache.keys, cache.values))
    )


def test_slack_zero_keeps_upstreams_state_and_refuses_wrapped_trims():
    cache = RotatingKVCache(8, slack=0)
    cache.update_and_fetch(*random_kv(1, 1, 11, 4))
    assert len(cache.state) == 6 and cache.trimmable_tokens() == 0


@pytest.mark.parametrize("slack", [-1, 6])
def test_a_slack_outside_the_window_raises(slack):
    with pytest.raises(ValueError, match="slack must be in"):
        RotatingKVCache(8, keep=3, slack=slack)


def test_a_saved_ring_with_slack_loads_and_trims_like_the_original():
    rng = random.Random(1)
    for updates in ([20, 1, 1, 1], [3] * 9, [1] * 30):
        original = RotatingKVCache(16, keep=2, slack=4)
        for S in updates:
            original.update_and_fetch(*random_kv(1, 1, S, 4))
        loaded = save_load(original)
        assert loaded.trimmable_tokens() == original.trimmable_tokens() >= 4
        n = rng.randint(1, 4)
        original.trim(n), loaded.trim(n)
        chunks = [random_kv(1, 1, S, 4) for S in (1, 1, 3, 1)]
        for want, got in zip(
            continue_with(original, chunks), continue_with(loaded, chunks)
        ):
            assert all(same(a, b) for a, b in zip(want, got))


def test_nbytes_counts_the_undo_ring():
    cache = RotatingKVCache(8, slack=2)
    cache.update_and_fetch(*random_kv(1, 2, 12, 4))
    # keys and values: 8 ring slots and 2 * slack undo slots, float32
    assert cache.nbytes == 2 * (8 + 4) * 2 * 4 * 4


@pytest.mark.parametrize(
    "item, value, match",
    [(8, 0, "slack 0"), (8, 9, "slack 9"), (9, 30, "undo positions"), (10, 2, "undo")],
)
def test_a_state_whose_undo_ring_contradicts_itself_raises(item, value, match):
    cache = RotatingKVCache(8, keep=2, slack=3)
    cache.update_and_fetch(*random_kv(1, 1, 20, 4))
    state = list(cache.state)
    RotatingKVCache._check_state(state)
    state[item] = value
    with pytest.raises(ValueError, match=match):
        RotatingKVCache._check_state(state)
