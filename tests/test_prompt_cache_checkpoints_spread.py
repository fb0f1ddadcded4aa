"""Ring checkpoints spread over the whole history (issue #51): past
``max_checkpoints`` a ring thins its older checkpoints geometrically, so a
branch anywhere in a long prompt restores from one not far before it."""

import bisect

import mlx.core as mx
import mlx_lm.models.cache as caches
import pytest
from ringref import random_kv, same, temporal

from mlx_lm_patched.bench.checkpoints import prefill

H, D = 1, 32


def ring(kind, max_size, every=0):
    """A ring (``kind`` "quantized": 8 bits) checkpointing every ``every`` tokens."""
    cache = caches.RotatingKVCache(max_size, checkpoint_every=every)
    return cache.to_quantized(group_size=32, bits=8) if kind == "quantized" else cache


def feed(cache, k, v, chunks, each=None):
    """Update ``cache`` with ``k``/``v`` in chunks of these sizes, calling
    ``each(tokens so far)`` after each."""
    at = 0
    for n in chunks:
        cache.update_and_fetch(k[..., at : at + n, :], v[..., at : at + n, :])
        at += n
        if each:
            each(at)
    mx.eval(cache.keys, cache.values)


def uncovered(taken, end, every):
    """Branch points in ``[1, end]`` whose nearest checkpoint at or before
    them (or the start) lies further back than half their distance from
    ``end`` plus three intervals."""
    out = []
    for b in range(1, end + 1):
        i = bisect.bisect_right(taken, b)
        if b - (taken[i - 1] if i else 0) > (end - b) / 2 + 3 * every:
            out.append(b)
    return out


def test_a_prefill_within_the_budget_keeps_every_multiple():
    """4,096 tokens at ``checkpoint_every=512``: all 8 multiples, as many as
    ``max_checkpoints`` holds by default (the newest 4 before)."""
    k, v = random_kv(1, H, 4096, D)
    cache = caches.RotatingKVCache(64, checkpoint_every=512)
    feed(cache, k, v, [1000] * 4 + [96])
    assert [c.offset for c in cache.checkpoints] == list(range(512, 4097, 512))


@pytest.mark.parametrize("chunk", [2048, 300, 24576])
def test_a_long_chunked_prefill_keeps_checkpoints_over_its_whole_history(chunk):
    """24,576 tokens at ``checkpoint_every=512``, whatever the chunks: after
    every update at most 8 checkpoints, at multiples of 512, the newest at
    the last one reached, and every branch point ``d`` tokens back has one
    within ``d / 2 + 3 * 512`` before it (the newest 4 reached back 2,048
    tokens)."""
    mx.random.seed(0)
    n, every = 24576, 512
    k, v = random_kv(1, H, n, D)
    cache = caches.RotatingKVCache(64, checkpoint_every=every)

    def check(at):
        taken = [c.offset for c in cache.checkpoints]
        assert len(taken) <= 8 and all(p % every == 0 for p in taken)
        assert taken[-1:] == [at // every * every] * (at >= every)
        assert uncovered(taken, at // every * every, every) == []

    feed(cache, k, v, [chunk] * (n // chunk) + [n % chunk] * (n % chunk > 0), check)
    assert len(cache.checkpoints) >= 7 and cache.checkpoints[0].offset <= n // 3


@pytest.mark.parametrize("kind", ["ring", "quantized"])
def test_right_padded_rows_spread_checkpoints_over_their_own_tokens(kind):
    """Rows of 3,000, 1,200 and 2,100 tokens prefilled together (right
    padding, 512-token chunks) at ``checkpoint_every=64``: each row's
    checkpoints cover its own tokens as a ring alone would (at most 8, the
    newest at its last multiple of 64, every branch within half its
    distance from that plus three intervals), each the single ring fed that
    row that far, bit for bit."""
    mx.random.seed(0)
    lengths, every = [3000, 1200, 2100], 64
    ks, vs = random_kv(3, H, 3000, D)
    cache = caches.BatchRotatingKVCache(48, [0, 0, 0], checkpoint_every=every)
    if kind == "quantized":
        cache = cache.to_quantized(group_size=32, bits=8)
    cache.prepare(lengths=lengths, right_padding=[3000 - n for n in lengths])
    feed(cache, ks, vs, [512] * 5 + [440])
    cache.finalize()
    for b, n in enumerate(lengths):
        taken = cache.extract(b).checkpoints
        at = [c.offset for c in taken]
        assert len(at) <= 8 and at[-1] == n // every * every
        assert uncovered(at, at[-1], every) == []
        for c in taken:
            alone = ring(kind, 48)
            feed(alone, ks[b : b + 1], vs[b : b + 1], [c.offset])
            assert same(temporal(c), temporal(alone))


@pytest.mark.parametrize("kind", ["ring", "quantized"])
def test_merged_rows_keep_a_spread_of_what_they_brought_and_took(kind):
    """Rings of 900 and 1,700 tokens (their checkpoints at multiples of 64)
    merged into a batch, which prefills 2,000 more tokens a row: the first
    row's new checkpoints lie 32 tokens off its own multiples (its padding),
    yet each row comes out of ``extract`` with at most 8, spread over all its
    tokens (every branch within half its distance from its newest plus
    three intervals), each the single ring fed that row that far."""
    mx.random.seed(0)
    every, had = 64, [900, 1700]
    ks, vs = random_kv(2, H, 3700, D)
    rows = []
    for b, n in enumerate(had):
        r = ring(kind, 48, every)
        feed(r, ks[b : b + 1], vs[b : b + 1], [500] * (n // 500) + [n % 500])
        rows.append(r)
    batch = rows[0].merge(rows)
    k, v = (
        mx.concatenate([x[b : b + 1, :, n : n + 2000] for b, n in enumerate(had)])
        for x in (ks, vs)
    )
    feed(batch, k, v, [500] * 4)
    for b, n in enumerate(had):
        taken = batch.extract(b).checkpoints
        at = [c.offset for c in taken]
        assert len(at) <= 8 and at[0] < n  # one it brought is still needed
        assert uncovered(at, at[-1], every) == []
        for c in taken:
            alone = ring(kind, 48)
            feed(alone, ks[b : b + 1], vs[b : b + 1], [c.offset])
            assert same(temporal(c), temporal(alone))


LONG = [(7 * j + 3) % 500 + 10 for j in range(4096)]
BRANCH = LONG[:3000] + [(11 * j + 5) % 500 + 10 for j in range(40)]
# The spread's bound for a branch at 3,000 of 4,096, every 256: more than half.
RESTORED = 3000 - (4096 - 3000) / 2 - 3 * 256


def test_a_branch_far_back_restores_most_of_its_prefix(load_tiny):
    """gemma3_text (window 256), a 4,096-token prompt cached with a
    checkpoint every 256 tokens, then one sharing its first 3,000: the store
    restores one within half the branch's distance from the end plus three
    intervals before it, so more than half of those 3,000 (the newest 4
    reached back to 3,328: all 3,040 were prefilled again); the logits are a
    fresh prefill's (within 1e-5), and each ring's ``nbytes`` counts its 8
    checkpoints, a window each."""
    model, _ = load_tiny("gemma3_text", sliding_window=256)
    cache = caches.make_prompt_cache(model, checkpoint_every=256)
    prefill(model, LONG, cache, 512)
    for r in (c for c in cache if isinstance(c, caches.RotatingKVCache)):
        assert len(r.checkpoints) == 8
        assert r.nbytes == 9 * (r.keys.nbytes + r.values.nbytes)
    store = caches.LRUPromptCache()
    store.insert_cache("m", LONG, cache)
    fetched, rest = store.fetch_nearest_cache("m", BRANCH)
    assert RESTORED <= len(BRANCH) - len(rest) <= 3000
    fresh = prefill(model, BRANCH, caches.make_prompt_cache(model), 512)
    got = prefill(model, rest, fetched, 512)
    assert mx.allclose(got, fresh, atol=1e-5, rtol=0).item()


def first_logprobs(model, prompts, caches=None):
    """The first prompt's ``BatchGenerator`` response after one token (its
    log-probabilities, cache and tokens), in a batch with the others."""
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(model, max_tokens=1, prefill_step_size=300)
    uids = generator.insert(prompts, caches=caches)
    done = {}
    while len(done) < len(prompts):
        done.update((r.uid, r) for r in generator.next_generated() if r.finish_reason)
    return done[uids[0]]


def test_a_batch_row_branches_far_back_with_fresh_logprobs(load_tiny):
    """As the server does it: the 4,096-token prompt prefilled in a batch
    (300-token chunks, beside a 700-token prompt whose last chunk is
    right-padded), its row's cache stored: the branch sharing the first
    3,000 tokens restores more than half of them, as a ring alone would, and
    its first token's log-probabilities are a fresh batch prefill's (within
    1e-5)."""
    model, _ = load_tiny("gemma3_text", sliding_window=256)
    other = [(5 * j + 1) % 400 + 10 for j in range(700)]
    rows = [caches.make_prompt_cache(model, checkpoint_every=256) for _ in range(2)]
    done = first_logprobs(model, [LONG, other], rows)
    store = caches.LRUPromptCache()
    store.insert_cache("m", done.all_tokens, done.prompt_cache)
    fetched, rest = store.fetch_nearest_cache("m", BRANCH)
    assert RESTORED <= len(BRANCH) - len(rest) <= 3000
    got = first_logprobs(model, [rest], [fetched]).logprobs
    want = first_logprobs(model, [BRANCH]).logprobs
    assert mx.allclose(got, want, atol=1e-5, rtol=0).item()


def test_an_agent_loops_checkpoints_hold_no_checkpoints_of_their_own(load_tiny):
    """Four turns of a conversation through ``BatchGenerator``, each turn's
    cache fetched from the store: every ring's checkpoints are bare windows,
    so its ``nbytes`` is its window and theirs. A checkpoint taken in a
    batch kept the checkpoints its rows brought, nested again each turn: an
    agent loop's entries doubled in ``nbytes`` a turn (162 GB logged for
    an 8B Gemma-3 shape after 8 turns)."""
    model, _ = load_tiny("gemma3_text", sliding_window=64)
    store, tokens = caches.LRUPromptCache(), LONG[:600]
    cache, rest = caches.make_prompt_cache(model, checkpoint_every=64), tokens
    for turn in range(4):
        done = first_logprobs(model, [rest], [cache])
        tokens = tokens[: len(tokens) - len(rest)] + done.all_tokens
        rings = [c for c in done.prompt_cache if isinstance(c, caches.RotatingKVCache)]
        for r in rings:
            assert len(r.checkpoints) >= 5
            assert all(not c.checkpoints for c in r.checkpoints)
            held = [r.keys, r.values] + [x for c in r.checkpoints for x in c.state[:2]]
            assert r.nbytes == sum(x.nbytes for x in held)
        store.insert_cache("m", tokens, done.prompt_cache)
        tokens += [(11 * j + turn) % 400 + 10 for j in range(200)]
        cache, rest = store.fetch_nearest_cache("m", tokens)
