"""prompt_cache_store: LRUPromptCache entries hold exactly the live tokens,
fetches share them instead of deep-copying, every eviction goes through
``_evict``."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    BatchKVCache,
    BatchRotatingKVCache,
    CacheList,
    ChunkedKVCache,
    KVCache,
    LRUPromptCache,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
)
from ringref import active, random_kv, same, single_stream

H, DK, DV = 2, 32, 64


def fed(cache, lengths):
    """Feed ``cache`` chunks of these lengths; returns all keys and values fed."""
    ks, vs = [], []
    for n in lengths:
        k, v = random_kv(1, H, n, DK)
        v = mx.concatenate([v, v], axis=-1)
        cache.update_and_fetch(k, v)
        ks.append(k)
        vs.append(v)
    mx.eval(cache.state)
    return mx.concatenate(ks, axis=2), mx.concatenate(vs, axis=2)


def ring_live(x, max_size, keep):
    """The tokens a ring of ``max_size`` slots keeps, in temporal order."""
    n = x.shape[2]
    if n <= max_size:
        return x
    return mx.concatenate([x[..., :keep, :], x[..., n - (max_size - keep) :, :]], 2)


def quantized(x):
    return tuple(mx.quantize(x, group_size=32, bits=8))


# Each case: (a cache, the arrays its live tokens are, read off a cache of its kind)
def case(kind):
    if kind == "kv":  # 300 tokens in 256-token steps of padding
        c = KVCache()
        k, v = fed(c, [200, 100])
        return c, (k, v), lambda c: c.state[:2]
    if kind == "chunked":
        c = ChunkedKVCache(512)
        k, v = fed(c, [200, 100])
        return c, (k, v), lambda c: c.state[:2]
    if kind == "ring":  # not wrapped: 40 of 64 slots
        c = RotatingKVCache(64, keep=4)
        k, v = fed(c, [30, 1, 1, 8])
        return c, (k, v), lambda c: c.state[:2]
    if kind == "wrapped_ring":  # wrapped, the oldest token mid-ring
        c = RotatingKVCache(64, keep=4)
        k, v = fed(c, [50, 20] + [1] * 9)
        live = tuple(ring_live(x, 64, 4) for x in (k, v))
        return c, live, lambda c: c.state[:2]
    if kind == "quantized":
        c = QuantizedKVCache(group_size=32, bits=8)
        k, v = fed(c, [100, 1, 1, 200])
        return c, (quantized(k), quantized(v)), lambda c: c.state[:2]
    if kind == "quantized_ring":
        ring = RotatingKVCache(64, keep=4)
        k, v = fed(ring, [50, 20])
        c = ring.to_quantized(group_size=32, bits=8)
        k2, v2 = fed(c, [1] * 9)
        k, v = (mx.concatenate(x, axis=2) for x in ((k, k2), (v, v2)))
        live = tuple(quantized(ring_live(x, 64, 4)) for x in (k, v))
        return c, live, lambda c: c.state[:2]
    if kind == "cache_list":
        c = CacheList(KVCache(), RotatingKVCache(64))
        kv = fed(c[0], [10])
        ring = tuple(ring_live(x, 64, 0) for x in fed(c[1], [70, 1]))
        return c, (kv, ring), lambda c: tuple(x.state[:2] for x in c.caches)
    if kind == "arrays":
        c = ArraysCache(2)
        c[0], c[1] = mx.ones((1, 3, 8)), mx.ones((1, 4, 4))
        return c, (c[0], c[1]), lambda c: tuple(c.cache)


KINDS = [
    "kv",
    "chunked",
    "ring",
    "wrapped_ring",
    "quantized",
    "quantized_ring",
    "cache_list",
    "arrays",
]


def tokens_of(cache):
    """Tokens for ``cache``: as many as it holds (insert_cache checks)."""
    n = getattr(cache, "offset", 3)
    return list(range(100, 100 + n))


def nbytes(tree):
    if isinstance(tree, mx.array):
        return tree.nbytes
    return sum(nbytes(x) for x in tree)


@pytest.mark.parametrize("kind", KINDS)
def test_stored_entry_holds_exactly_the_live_tokens(patched, exact_active_memory, kind):
    mx.random.seed(0)
    cache, live, read = case(kind)
    lru = LRUPromptCache()
    tokens = tokens_of(cache)
    lru.insert_cache("m", tokens, [cache])
    del cache
    assert lru.nbytes == nbytes(live)
    (fetched,), rest = lru.fetch_nearest_cache("m", tokens)
    assert rest == [] and same(read(fetched), live)
    del fetched
    # What the entry holds on its own: no view of the working buffers.
    held = active()
    lru.trim_to(n_sequences=0)
    assert held - active() == nbytes(live)


def batch(kind):
    if kind == "batch_kv":
        c = BatchKVCache([0, 5, 10])
    else:
        c = BatchRotatingKVCache(64, [0, 5, 10])
    for n in [40] + [1] * 30:  # the ring wraps
        c.update_and_fetch(*random_kv(3, H, n, DK))
    return c.to_quantized(group_size=32, bits=8) if kind == "batch_quantized" else c


@pytest.mark.parametrize("kind", KINDS + ["batch_kv", "batch_ring", "batch_quantized"])
def test_nbytes_is_what_a_cache_holds(patched, exact_active_memory, kind):
    mx.random.seed(0)
    cache = batch(kind) if kind.startswith("batch") else case(kind)[0]
    mx.eval(cache.state)
    with_cache = active()
    nbytes = cache.nbytes
    del cache
    held = with_cache - active()
    # Besides the tokens, a batch holds its rows' int32 offsets and paddings.
    assert nbytes <= held <= nbytes + 2 * 3 * 4


@pytest.mark.parametrize("kind", ["kv", "quantized"])  # 256-token steps
def test_upstream_stores_more_than_the_live_tokens(upstream, kind):
    mx.random.seed(0)
    cache, live, _ = case(kind)
    lru = LRUPromptCache()
    lru.insert_cache("m", [1, 2, 3], [cache])
    assert lru.nbytes > nbytes(live)


@pytest.mark.parametrize("kind", ["kv", "ring", "wrapped_ring", "quantized"])
def test_writing_a_fetched_cache_leaves_the_entry_as_it_was(patched, kind):
    mx.random.seed(0)
    cache, live, read = case(kind)
    lru = LRUPromptCache()
    tokens = tokens_of(cache)
    lru.insert_cache("m", tokens, [cache])
    # The working cache shares the entry's buffers until it is written.
    (working,), rest = lru.fetch_nearest_cache("m", tokens + [4])
    assert rest == [4]
    if kind != "wrapped_ring":  # a wrapped ring cannot step back
        working.trim(2)
    fed(working, [1, 1, 5])
    (again,), _ = lru.fetch_nearest_cache("m", tokens)
    assert same(read(again), live)


@pytest.mark.parametrize(
    "family,overrides,kv_bits",
    [
        ("gemma3_text", {}, None),  # sliding window 64: the ring wraps
        ("llama", {}, 8),  # QuantizedKVCache after the prompt
    ],
)
def test_greedy_tokens_after_a_fetch_match_upstream(
    request, load_tiny, family, overrides, kv_bits
):
    model, _ = load_tiny(family, **overrides)
    prompt = [(7 * j + 3) % 500 for j in range(100)]
    kwargs = {} if kv_bits is None else {"kv_bits": kv_bits, "kv_group_size": 32}
    tokens = {}
    for side in ("upstream", "patched"):
        request.getfixturevalue(side)
        lru = LRUPromptCache()
        # The cache holds the prompt and the token it generated
        out, cache = single_stream(model, prompt, 1, **kwargs)
        lru.insert_cache("m", prompt + out, cache)
        cache, rest = lru.fetch_nearest_cache("m", prompt + out + [5, 9])
        tokens[side] = single_stream(model, rest, 8, cache=cache, **kwargs)[0]
    assert tokens["patched"] == tokens["upstream"]


class Spilling(LRUPromptCache):
    """Keeps what it evicts, as a disk tier would."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.spilled = {}

    def _evict(self):
        model, tokens, entry = super()._evict()
        self.spilled[tuple(tokens)] = entry
        return model, tokens, entry


def test_every_eviction_goes_through_evict(patched):
    entry = H * 3 * (DK + DV) * 4  # one 3-token KVCache, float32
    lru = Spilling(max_size=3, max_bytes=2 * entry)
    for i in range(4):  # by bytes on insert
        c = KVCache()
        fed(c, [3])
        tokens = [i, i + 10, i + 20]
        lru.insert_cache("m", tokens, [c], cache_type=["user", "assistant"][i % 2])
    assert list(lru.spilled) == [(0, 10, 20), (1, 11, 21)]
    lru.trim_to(n_sequences=1)  # by count
    assert list(lru.spilled)[2:] == [(3, 13, 23)]  # assistant entries go first
    assert [e.nbytes for e in lru.spilled.values()] == [entry] * 3
    assert len(lru) == 1 and lru.nbytes == entry
    stats = lru.stats_by_type()
    assert (stats["user"]["n_bytes"], stats["assistant"]["n_bytes"]) == (entry, 0)


def settle(store):
    """Quantize ``store``'s entries as a byte budget that needs room does."""
    n = len(store)
    store.trim_to(n_bytes=store.nbytes - 1)
    assert len(store) == n  # quantized, none evicted


@pytest.mark.parametrize("bits, most", [(8, 0.55), (4, 0.30)])
def test_entries_quantized_at_rest_take_a_fraction_of_the_bf16_bytes(bits, most):
    """Quantized at rest: 8-bit entries take at most 0.55x, 4-bit at most
    0.30x of bfloat16's bytes; a fetch gives back a
    bfloat16 ``KVCache`` holding what ``mx.quantize``/``mx.dequantize``
    make of the tokens, bit for bit."""
    plain, at_rest = LRUPromptCache(), LRUPromptCache(bits=bits, group_size=64)
    cache = [KVCache() for _ in range(2)]
    for c in cache:
        k, v = random_kv(1, H, 300, 128, dtype=mx.bfloat16)
        c.update_and_fetch(k, v)
    tokens = list(range(300))
    for store in (plain, at_rest):
        store.insert_cache("m", tokens, cache)
    settle(at_rest)
    assert at_rest.nbytes <= most * plain.nbytes
    entry = at_rest._blocks.assemble(at_rest._trie.get("m", tokens).prompt_cache)
    assert all(type(c) is QuantizedKVCache and c.bits == bits for c in entry)
    fetched, rest = at_rest.fetch_nearest_cache("m", tokens + [7])
    assert rest == [7]
    for got, want in zip(fetched, cache):
        assert type(got) is KVCache and got.offset == 300
        for x, y in ((got.keys, want.keys), (got.values, want.values)):
            q = mx.quantize(y[..., :300, :], group_size=64, bits=bits)
            assert same(x[..., :300, :], mx.dequantize(*q, group_size=64, bits=bits))


def test_entries_rest_as_computed_until_an_insert_after_a_fetch(monkeypatch):
    """With ``bits``, the entries stored since the last fetch are kept as
    computed: the next turn of a conversation fetches its tokens bit for bit
    and, storing the longer prompt, drops the entry unquantized; an insert
    after a fetch quantizes those stored before it, and a byte budget that
    needs room quantizes the rest rather than evict them."""
    quantizes = []
    to_quantized = KVCache.to_quantized
    monkeypatch.setattr(
        KVCache,
        "to_quantized",
        lambda self, **kw: quantizes.append(self) or to_quantized(self, **kw),
    )
    store, plain = LRUPromptCache(bits=8), LRUPromptCache()
    turn, cache = list(range(40)), [KVCache()]
    keys, _ = fed(cache[0], [40])
    store.insert_cache("m", turn, cache)
    fetched, rest = store.fetch_nearest_cache("m", turn + [99])
    assert rest == [99] and same(fetched[0].state[0], keys)
    fed(fetched[0], [1])
    for lru in (store, plain):
        lru.insert_cache("m", turn + [99], fetched)
    assert len(store) == 1 and quantizes == []
    assert store.nbytes == plain.nbytes
    other = [KVCache()]
    fed(other[0], [20])
    store.insert_cache("m", list(range(100, 120)), other)  # no fetch since
    assert len(store) == 2 and quantizes == []
    store.fetch_nearest_cache("m", [7])
    third = [KVCache()]
    fed(third[0], [1])
    store.insert_cache("m", [7], third)  # both quantized
    assert len(store) == 3 and len(quantizes) == 2
    (entry,) = store._trie.get("m", turn + [99]).prompt_cache
    assert type(entry) is QuantizedKVCache and entry.offset == 41
    settle(store)
    assert len(quantizes) == 3


def test_a_fetch_from_a_store_at_rest_trims_back_to_the_common_prefix():
    store = LRUPromptCache(bits=8)
    cache = [KVCache()]
    cache[0].update_and_fetch(*random_kv(1, H, 40, DK))
    store.insert_cache("m", list(range(40)), cache)
    settle(store)
    fetched, rest = store.fetch_nearest_cache("m", list(range(30)) + [99])
    assert rest == [99] and fetched[0].offset == 30
    # The entry itself stays whole and quantized.
    (entry,) = store._trie.get("m", list(range(40))).prompt_cache
    assert type(entry) is QuantizedKVCache and entry.offset == 40


@pytest.mark.parametrize("bits, most", [(8, 0.55), (4, 0.30)])
def test_sliding_layers_rest_quantized_and_step_back_within_their_slack(bits, most):
    """A wrapped bfloat16 ring (a sliding layer with slack) rests as a
    ``QuantizedRotatingKVCache`` of its live tokens and undo ring, at most
    0.55x / 0.30x of bfloat16's bytes; a fetch trims it back to a common
    prefix within the slack and gives a bfloat16 ring that holds what
    ``mx.quantize``/``mx.dequantize`` make of the tokens the plain store's
    fetch holds, bit for bit."""
    plain, at_rest = LRUPromptCache(), LRUPromptCache(bits=bits, group_size=64)
    ring = RotatingKVCache(64, keep=4, slack=8)
    for n in [100] + [1] * 40:  # wrapped, decoded past the window
        ring.update_and_fetch(*random_kv(1, H, n, 128, dtype=mx.bfloat16))
    tokens = list(range(140))
    for store in (plain, at_rest):
        store.insert_cache("m", tokens, [ring])
    settle(at_rest)
    assert at_rest.nbytes <= most * plain.nbytes
    (entry,) = at_rest._trie.get("m", tokens).prompt_cache
    assert type(entry) is QuantizedRotatingKVCache and entry.bits == bits
    assert entry.keys[0].shape[2] == 64  # the live tokens: no more slots
    prompt = tokens[:135] + [999]  # 5 tokens back: within the slack
    (want,), rest = plain.fetch_nearest_cache("m", prompt)
    (got,), rest_at_rest = at_rest.fetch_nearest_cache("m", prompt)
    assert rest == rest_at_rest == [999]
    assert type(got) is RotatingKVCache and got.keys.dtype == mx.bfloat16
    assert (got.offset, got._idx, got.slack) == (want.offset, want._idx, 8)
    for x, y in ((got.keys, want.keys), (got.values, want.values)):
        q = mx.quantize(y, group_size=64, bits=bits)
        assert same(x, mx.dequantize(*q, group_size=64, bits=bits))


def test_bits_other_than_4_or_8_are_refused():
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        LRUPromptCache(bits=3)


def test_an_insert_schedules_every_layers_copy_at_once(patched, monkeypatch):
    """``insert_cache`` copies a layer at a time and schedules the copies in
    one ``mx.async_eval`` (each call costs the host a graph and a commit:
    a Gemma-3 entry has 27 rings); it waits for none of them."""
    layers = [RotatingKVCache(64, 4) for _ in range(5)]
    for c in layers:
        fed(c, [100])
    calls = []
    for name in ("eval", "async_eval"):

        def record(*a, _name=name, _fn=getattr(mx, name)):
            calls.append(_name)
            return _fn(*a)

        monkeypatch.setattr(mx, name, record)
    lru = LRUPromptCache()
    lru.insert_cache("m", list(range(100)), layers)
    assert calls == ["async_eval"]
    got, rest = lru.fetch_nearest_cache("m", list(range(100)) + [7])
    assert rest == [7] and all(
        same(a.state[:2], b.state[:2]) for a, b in zip(got, layers)
    )


def test_an_agent_turn_builds_one_working_cache(patched, monkeypatch):
    """A new turn resends the last prompt, then a reply its client rendered
    otherwise: the entry with the reply cannot go back past its slack, its
    newest checkpoint is older than the entry a server keeps of the last
    prompt (less its last token), so the fetch takes that entry and builds
    no cache from a checkpoint first."""
    prompt, reply = list(range(200)), list(range(1000, 1040))
    k, v = random_kv(1, H, 240, DK)
    lru = LRUPromptCache()
    for tokens in (prompt[:-1], prompt + reply):
        c = RotatingKVCache(48, slack=8, checkpoint_every=32)
        for a, b in ((0, 199), (199, len(tokens))):
            if b > a:
                c.update_and_fetch(k[..., a:b, :], v[..., a:b, :])
        lru.insert_cache("m", tokens, [c])
    built = []
    working = lru._working_cache
    monkeypatch.setattr(lru, "_working_cache", lambda e: built.append(e) or working(e))
    turn = prompt + [5] * 30
    (got,), rest = lru.fetch_nearest_cache("m", turn)
    assert rest == turn[199:] and got.offset == 199 and len(built) == 1


def test_the_same_tokens_again_keep_the_entry_held(patched):
    """A prompt resent or a system prompt shared is inserted again, the same
    tokens of the same type: the entry held stays (not copied again: a
    Gemma-3 24k-token entry took ~35 ms before the first token), moved to
    the most recently used; of another type it is replaced."""
    lru = LRUPromptCache(max_size=2)
    first, other = [RotatingKVCache(64, 4)], [RotatingKVCache(64, 4)]
    fed(first[0], [3])
    fed(other[0], [3])
    lru.insert_cache("m", [1, 2, 3], first, cache_type="user")
    held = lru._trie.get("m", [1, 2, 3])
    lru.insert_cache("m", [4, 5, 6], other, cache_type="user")
    again = [RotatingKVCache(64, 4)]
    fed(again[0], [3])
    lru.insert_cache("m", [1, 2, 3], again, cache_type="user")
    assert lru._trie.get("m", [1, 2, 3]) is held and lru.nbytes == 2 * held.nbytes
    lru.trim_to(n_sequences=1)  # the older of the two goes
    assert lru._trie.get("m", [1, 2, 3]) is held and len(lru) == 1
    lru.insert_cache("m", [1, 2, 3], again, cache_type="assistant")
    replaced = lru._trie.get("m", [1, 2, 3])
    assert replaced is not held and replaced.cache_type == "assistant"
    assert len(lru) == 1 and lru.stats_by_type()["user"]["n_sequences"] == 0


def test_a_batch_row_s_ring_is_stored_as_extract_copied_it(
    patched, exact_active_memory
):
    """The server stores every request's cache at its end, a row that
    ``BatchRotatingKVCache.extract`` copied out with only its live tokens:
    the entry shares those buffers rather than copying them again (a working
    ring's buffer is still copied to its live tokens), and an in-place write
    to the row's arrays afterwards leaves the entry as it was."""
    rows = [RotatingKVCache(64, keep=4, slack=4) for _ in range(2)]
    for c, n in zip(rows, (80, 50)):
        fed(c, [n])
    row = BatchRotatingKVCache.merge(rows).extract(0)
    mx.eval(row.state)
    del rows
    working = RotatingKVCache(64, keep=4)
    fed(working, [40])
    lru = LRUPromptCache()
    grown = []
    for c in (row, working):
        before = active()
        lru.insert_cache("m", tokens_of(c), [c])
        mx.synchronize()
        grown.append(active() - before)
    assert grown == [0, nbytes(working.state[:2])]
    (held,) = lru._trie.get("m", tokens_of(row)).prompt_cache
    want = [mx.array(x) for x in held.state[:2]]
    mx.eval(want)
    row.keys[..., :8, :] = 0
    row.values[..., :8, :] = 0
    (got,), rest = lru.fetch_nearest_cache("m", tokens_of(held))
    assert rest == [] and same(got.state[:2], want)
