"""prompt_cache_blocks: the entries of one prompt cache share the blocks of
their common prefix, count each once, and a fetch continues as a fresh
prefill would."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    KVCache,
    LRUPromptCache,
    PromptBlocks,
    QuantizedKVCache,
    QuantizedRotatingKVCache,
    RotatingKVCache,
    SharedPrefixCache,
    load_prompt_cache,
    make_prompt_cache,
    save_prompt_cache,
)
from mlx_lm.models.prompt_cache_disk import DiskLRUPromptCache, DiskPromptCache
from ringref import active, random_kv, same

H, D = 2, 32
PER_TOKEN = 2 * H * D * 4  # one float32 KVCache layer
SIZE = PromptBlocks().block_size


def conversations(n, prefix, tail, dtype=mx.float32):
    """``n`` ``(tokens, [KVCache])``: one prefix of ``prefix`` tokens (the
    same keys and values in each), then ``tail`` tokens of their own."""
    k0, v0 = random_kv(1, H, prefix, D, dtype=dtype)
    out = []
    for i in range(n):
        k, v = random_kv(1, H, tail, D, dtype=dtype)
        c = KVCache()
        c.update_and_fetch(mx.concatenate([k0, k], 2), mx.concatenate([v0, v], 2))
        mx.eval(c.state)
        out.append(
            (list(range(prefix)) + [1000 * (i + 1) + j for j in range(tail)], [c])
        )
    return out


def live(cache):
    """A ``KVCache``'s keys and values without their padding."""
    return tuple(x[..., : cache.offset, :] for x in cache.state[:2])


def held_alone(prefix, tails):
    """Bytes of entries of ``prefix`` shared tokens and these tails: the
    prefix's whole blocks once, every entry the rest of its tokens."""
    shared = prefix // SIZE * SIZE
    return PER_TOKEN * (shared + sum(prefix - shared + t for t in tails))


def test_a_shared_prefix_is_stored_once_and_held_once(patched, exact_active_memory):
    """8 conversations of a 2,000-token prefix and 200 tokens of their own:
    at most 1.3x the prefix once plus the tails (issue #28); the memory the
    entries hold is what ``nbytes`` says."""
    mx.random.seed(0)
    convs = conversations(8, 2000, 200)
    lru = LRUPromptCache(max_size=8)
    for tokens, cache in convs:
        lru.insert_cache("m", tokens, cache)
    lru._settle()  # at rest, as the next request's insert makes them
    assert len(lru) == 8
    assert lru.nbytes == held_alone(2000, [200] * 8)
    assert lru.nbytes <= 1.3 * PER_TOKEN * (2000 + 8 * 200)
    del convs, cache
    held = active()
    n = lru.nbytes
    lru.trim_to(n_sequences=0)
    assert held - active() == n


def test_the_budget_counts_a_shared_block_once(patched):
    mx.random.seed(0)
    budget = held_alone(2000, [200] * 8)
    lru = LRUPromptCache(max_size=100, max_bytes=budget)
    for tokens, cache in conversations(8, 2000, 200):
        lru.insert_cache("m", tokens, cache)
    assert len(lru) == 8 and lru.nbytes == budget
    lru.trim_to(n_bytes=budget - 1)  # one entry leaves, its own tokens only
    assert len(lru) == 7 and lru.nbytes == held_alone(2000, [200] * 7)


def test_a_block_leaves_with_the_last_entry_that_holds_it(patched, exact_active_memory):
    mx.random.seed(0)
    convs = conversations(3, 300, 40)
    lru = LRUPromptCache()
    for tokens, cache in convs:
        lru.insert_cache("m", tokens, cache)
    lru._settle()
    del convs, cache
    held = active()
    for n in (2, 1, 0):  # an entry's own tokens go; the last one the blocks too
        lru.trim_to(n_sequences=n)
        assert lru.nbytes == (held_alone(300, [40] * n) if n else 0)
        assert held - active() == held_alone(300, [40] * 3) - lru.nbytes
    assert len(lru._blocks) == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_fetched_conversation_continues_with_a_fresh_prefills_logits(
    patched, load_tiny, dtype
):
    """Exact: the logits after a fetch (its prefix blocks stored from another
    conversation) are those of a fresh cache fed the same chunks."""
    model, _ = load_tiny("llama", dtype=dtype)
    system = [(7 * j + 3) % 500 for j in range(300)]
    convs = [system + [(11 * j + i) % 500 for j in range(40)] for i in range(3)]
    turn = [(13 * j + 2) % 500 for j in range(10)]
    lru = LRUPromptCache()
    for tokens in convs:
        cache = make_prompt_cache(model)
        model(mx.array(tokens)[None], cache=cache)
        lru.insert_cache("m", tokens, cache)
    lru._settle()
    first, last = (lru._trie.get("m", t).prompt_cache for t in (convs[0], convs[-1]))
    assert all(a.blocks[0] is b.blocks[0] for a, b in zip(first, last))  # shared

    cache, rest = lru.fetch_nearest_cache("m", convs[-1] + turn)
    assert rest == turn
    got = model(mx.array(rest)[None], cache=cache)
    fresh = make_prompt_cache(model)
    model(mx.array(convs[-1])[None], cache=fresh)
    want = model(mx.array(turn)[None], cache=fresh)
    assert same(got, want)


def test_writing_a_fetched_cache_leaves_the_blocks_as_they_were(patched):
    mx.random.seed(0)
    convs = conversations(2, 300, 40)
    lru = LRUPromptCache()
    for tokens, cache in convs:
        lru.insert_cache("m", tokens, cache)
    lru._settle()
    # A branch inside a shared block: trimmed back to 100 tokens, then written.
    (working,), rest = lru.fetch_nearest_cache("m", convs[0][0][:100] + [7, 8])
    assert working.offset == 100 and rest == [7, 8]
    working.update_and_fetch(*random_kv(1, H, 250, D))
    mx.eval(working.state)
    for tokens, (want,) in convs:
        (got,), _ = lru.fetch_nearest_cache("m", tokens)
        assert same(got.state[:2], live(want))


def test_an_insert_copies_the_working_cache_once_and_keeps_none_of_it(
    patched, exact_active_memory
):
    """An insert peaks at one copy of the entry, and writing the working
    cache in place afterwards leaves the entry as it was."""
    mx.random.seed(0)
    ((tokens, (cache,)),) = conversations(1, 700, 60)
    want = tuple(mx.array(x) for x in live(cache))
    mx.eval(want)
    lru = LRUPromptCache()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = active()
    lru.insert_cache("m", tokens, [cache])
    assert mx.get_peak_memory() - before < 1.2 * PER_TOKEN * 760
    assert active() - before == lru.nbytes == PER_TOKEN * 760
    cache.trim(300)  # the working cache goes on, in its own buffer
    cache.update_and_fetch(*random_kv(1, H, 300, D))
    mx.eval(cache.state)
    (got,), _ = lru.fetch_nearest_cache("m", tokens)
    assert same(got.state[:2], want)


def test_two_models_or_two_layouts_never_share_a_block(patched):
    mx.random.seed(0)
    ((tokens, cache),) = conversations(1, 300, 0)
    lru = LRUPromptCache()
    lru.insert_cache("a", tokens, cache)
    one = lru.nbytes
    lru.insert_cache("b", tokens, cache)
    lru._settle()
    assert lru.nbytes == 2 * one
    half = [KVCache()]
    half[0].update_and_fetch(*(x.astype(mx.float16) for x in live(cache[0])))
    half[0].update_and_fetch(*(x[..., :1, :] for x in live(half[0])))  # token 1
    lru.insert_cache("b", tokens + [1], half)  # pops "b"'s float32 entry
    lru._settle()
    assert lru.nbytes == one + one // 2 * 301 // 300
    for model, prompt, want in (("a", tokens, cache[0]), ("b", tokens + [1], half[0])):
        (got,), _ = lru.fetch_nearest_cache(model, prompt)
        assert same(got.state[:2], live(want))


@pytest.mark.parametrize("bits", [None, 8])
def test_quantized_entries_share_their_blocks(patched, bits):
    """``QuantizedKVCache`` entries, and entries quantized at rest
    (``bits=8``), share blocks; a fetch gives back what the store holds, bit
    for bit."""
    mx.random.seed(0)
    lru = LRUPromptCache(bits=bits)
    convs = conversations(4, 300, 40)
    if bits is None:
        convs = [(t, [c[0].to_quantized(group_size=32, bits=4)]) for t, c in convs]
    for tokens, cache in convs:
        lru.insert_cache("m", tokens, cache)
    lru._settle()
    entries = [lru._trie.get("m", t).prompt_cache[0] for t, _ in convs]
    assert all(type(e.template) is QuantizedKVCache for e in entries)
    # The prefix's whole blocks once, then each entry's own tokens.
    at_rest = lambda c: lru._quantized([lru._at_rest(c)])[0]
    whole = at_rest(convs[0][1][0]).nbytes  # 340 tokens, bytes per token alike
    shared = 300 // SIZE * SIZE
    assert lru.nbytes * 340 == whole * (shared + 4 * (340 - shared))
    for tokens, cache in convs:
        (got,), _ = lru.fetch_nearest_cache("m", tokens)
        want = at_rest(cache[0])
        if bits is None:
            assert same(got.state, want.state)
        else:  # dequantized from the 8-bit blocks
            assert type(got) is KVCache and same(got.state, want.to_kv_cache().state)


def test_rings_keep_whole_entries(patched):
    mx.random.seed(0)
    ring, kv = RotatingKVCache(128, keep=4), KVCache()
    for c in (ring, kv):
        c.update_and_fetch(*random_kv(1, H, 300, D))
    lru = LRUPromptCache()
    lru.insert_cache("m", list(range(300)), [ring, kv])
    lru._settle()
    stored = lru._trie.get("m", list(range(300))).prompt_cache
    assert type(stored[0]) is RotatingKVCache and type(stored[1]) is SharedPrefixCache


def test_an_entry_evicted_to_disk_is_written_whole(patched, tmp_path):
    mx.random.seed(0)
    disk = DiskPromptCache(str(tmp_path))
    lru = DiskLRUPromptCache(disk, max_size=1)
    convs = conversations(2, 300, 40)
    for tokens, cache in convs:
        lru.insert_cache("m", tokens, cache)
    disk.flush()
    (got,), rest = disk.get("m", convs[0][0])
    assert rest == [] and same(got.state[:2], live(convs[0][1][0]))
    disk.close()


def test_a_file_naming_a_shared_layer_is_refused_naming_it(patched, tmp_path):
    """Entries' layers live only in memory: a file claiming one is a
    ``ValueError`` naming the file, not a layer without blocks."""
    path = str(tmp_path / "cache.safetensors")
    cache = KVCache()
    cache.update_and_fetch(*random_kv(1, H, 4, D))
    save_prompt_cache(path, [cache])
    arrays, metadata = mx.load(path, return_metadata=True)
    named = {k: v.replace("KVCache", "SharedPrefixCache") for k, v in metadata.items()}
    assert named != metadata
    mx.save_safetensors(path, arrays, named)
    with pytest.raises(
        ValueError, match="cache.safetensors: layer 0 .*never in a file"
    ):
        load_prompt_cache(path)


def test_a_block_size_below_one_is_refused():
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        PromptBlocks(0)


def test_a_chain_is_the_same_hashed_whole_or_from_the_last_chains():
    """``chain`` reuses the digests of the last chains it made (a growing
    conversation hashes only its new blocks): across models, edits,
    shorter and longer prompts each chain equals the one hashed from
    scratch (SHA-256 of the parent digest and the block's tokens)."""
    import hashlib
    import random

    def scratch(model, tokens):
        seed, out = hashlib.sha256(repr(model).encode()).digest(), []
        for s in range(0, len(tokens) - SIZE + 1, SIZE):
            block = repr(list(tokens[s : s + SIZE])).encode()
            out.append(seed := hashlib.sha256(seed + block).digest())
        return out

    r = random.Random(0)
    base = [r.randrange(1000) for _ in range(20 * SIZE)]
    blocks = PromptBlocks()
    for _ in range(200):
        model = r.choice(["a", "b", ("c", None), "d", "e", "f"])
        n = r.randrange(len(base))
        tokens = base[:n]
        if r.random() < 0.3:  # an edit: a prefix, then tokens of its own
            tokens = tokens[: r.randrange(n + 1)] + [r.randrange(1000)] * r.randrange(
                99
            )
        assert blocks.chain(model, tokens) == scratch(model, tokens)


def test_entries_are_cut_into_blocks_at_an_insert_after_a_fetch(patched):
    """An entry is stored whole (the next request fetches it without a join
    of blocks) and cut into shared blocks at the first insert after a
    fetch, but for the entry that fetch took; without fetches, at most
    ``whole_entries`` stay whole."""
    mx.random.seed(0)
    convs = conversations(5, 300, 40)
    lru = LRUPromptCache()

    def whole():
        held = [lru._trie.get("m", t).prompt_cache[0] for t, _ in convs[: len(lru)]]
        return [type(c) is KVCache for c in held]

    lru.insert_cache("m", *convs[0])
    lru.insert_cache("m", *convs[1])
    (got,), rest = lru.fetch_nearest_cache("m", convs[1][0] + [7])
    assert rest == [7] and same(got.state[:2], live(convs[1][1][0]))
    lru.insert_cache("m", *convs[2])
    assert whole() == [False, True, True]
    for tokens, cache in convs[3:]:  # no fetch: the oldest of 3 whole cut
        lru.insert_cache("m", tokens, cache)
    assert whole() == [False, False, True, True, True]


def test_rest_puts_the_whole_entries_and_the_taken_one_at_rest(patched):
    """``rest`` (a server idle) puts every entry kept whole at rest, the
    one a fetch took too: quantized with ``bits`` and cut into blocks, in
    fewer bytes; a fetch after gives back what the store holds; with none
    whole it does nothing."""
    mx.random.seed(0)
    convs = conversations(3, 300, 40, dtype=mx.bfloat16)
    lru = LRUPromptCache(bits=8)
    lru.insert_cache("m", *convs[0])
    lru.fetch_nearest_cache("m", convs[0][0] + [7])
    lru.insert_cache("m", *convs[1])
    lru.insert_cache("m", *convs[2])
    whole = lru.nbytes
    assert lru.rest() and not lru.rest()
    held = [lru._trie.get("m", t).prompt_cache[0] for t, _ in convs]
    assert all(type(c) is not KVCache for c in held)
    assert lru.nbytes < 0.6 * whole
    (got,), _ = lru.fetch_nearest_cache("m", convs[2][0] + [7])
    q = convs[2][1][0].to_quantized(group_size=64, bits=8)
    assert same(got.state[:2], q.to_kv_cache().state[:2])


def test_a_system_prompts_entry_every_request_takes_stays_whole(patched):
    """Requests behind one system prompt (rings: its entry is not dropped as
    a prefix) each take its entry: it stays as computed, not quantized at
    rest, while the requests' own entries go to rest (a Gemma-3 server
    dequantized it for every request after the second)."""
    mx.random.seed(0)
    system, lru = list(range(300)), LRUPromptCache(bits=8)

    def ring(n):
        c = RotatingKVCache(64, keep=4)
        c.update_and_fetch(*random_kv(1, H, n, D))
        return [c]

    lru.insert_cache("m", system, ring(300))
    requests = [system + [1000 * (i + 1) + j for j in range(40)] for i in range(4)]
    for tokens in requests:
        cache, rest = lru.fetch_nearest_cache("m", tokens)
        assert rest == tokens[300:] and cache[0].offset == 300
        lru.insert_cache("m", tokens, ring(340))
    held = [type(lru._trie.get("m", t).prompt_cache[0]) for t in [system] + requests]
    assert held == [RotatingKVCache] + [QuantizedRotatingKVCache] * 3 + [
        RotatingKVCache
    ]
