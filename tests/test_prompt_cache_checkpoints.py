"""Ring checkpoints: rings keep copies of their window every
``checkpoint_every`` tokens of a prefill, and a prompt cache restores the
nearest one where a wrapped entry cannot be trimmed back to a branch."""

import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import (
    BatchRotatingKVCache,
    LRUPromptCache,
    RotatingKVCache,
    make_prompt_cache,
)
from ringref import data_pointer, free_port, random_kv, same, temporal

H, D = 2, 32


def feed(cache, k, v, chunks):
    """Update ``cache`` with ``k``/``v`` in chunks of these sizes."""
    at = 0
    for n in chunks:
        cache.update_and_fetch(k[..., at : at + n, :], v[..., at : at + n, :])
        at += n
    mx.eval(cache.keys, cache.values)


def ring(kind, max_size, keep, every=0):
    """A ring (``kind`` "quantized": 8 bits) checkpointing every ``every`` tokens."""
    cache = RotatingKVCache(max_size, keep, checkpoint_every=every)
    return cache.to_quantized(group_size=32, bits=8) if kind == "quantized" else cache


@pytest.mark.parametrize("kind", ["ring", "quantized"])
@pytest.mark.parametrize(
    "keep,chunks", [(0, [200]), (4, [200]), (4, [30, 50, 1, 1, 70, 48]), (0, [45] * 4)]
)
def test_a_checkpoint_is_the_ring_fed_only_that_far(kind, keep, chunks):
    """Each checkpoint holds, bit for bit, what a ring fed only the tokens up
    to its position holds, whatever the chunks."""
    mx.random.seed(0)
    k, v = random_kv(1, H, sum(chunks), D)
    cache = ring(kind, 40, keep, every=32)
    feed(cache, k, v, chunks)
    assert cache.checkpoints, "no checkpoint taken"
    for c in cache.checkpoints:
        assert c.offset % 32 == 0
        alone = ring(kind, 40, keep)
        feed(alone, k, v, [c.offset])
        assert same(temporal(c), temporal(alone))


def test_no_checkpoints_by_default_and_at_most_max_checkpoints():
    """None without ``checkpoint_every``; with it, every multiple while
    ``max_checkpoints`` (8 by default) hold them, then at most that many,
    the newest at the end."""
    mx.random.seed(0)
    k, v = random_kv(1, H, 1000, D)
    cache = RotatingKVCache(64)
    feed(cache, k, v, [100] * 10)
    assert cache.checkpoints == ()
    cache = RotatingKVCache(64, checkpoint_every=50)
    feed(cache, k, v, [100] * 4)
    assert [c.offset for c in cache.checkpoints] == list(range(50, 401, 50))
    for most in (8, 2):
        cache = RotatingKVCache(64, checkpoint_every=50, max_checkpoints=most)
        feed(cache, k, v, [100] * 10)
        taken = [c.offset for c in cache.checkpoints]
        assert 1 < len(taken) <= most and taken[-1] == 1000
        assert all(p % 50 == 0 for p in taken)


def test_checkpoints_count_in_nbytes_and_a_trim_drops_those_past_the_end():
    mx.random.seed(0)
    k, v = random_kv(1, H, 70, D)
    cache = RotatingKVCache(64, checkpoint_every=16)
    feed(cache, k, v, [20, 50])
    assert [c.offset for c in cache.checkpoints] == [32, 48, 64]
    window = 2 * H * D * 4  # keys and values, float32, a token
    assert cache.nbytes == window * (64 + 32 + 48 + 64)
    cache = RotatingKVCache(64, slack=10, checkpoint_every=16)
    feed(cache, k, v, [20, 50])
    assert cache.trim(10) == 10
    assert [c.offset for c in cache.checkpoints] == [32, 48]


def test_decode_still_writes_the_ring_in_place():
    """A checkpoint is a copy: the ring it was cut from is still written in
    place by decode steps."""
    mx.random.seed(0)
    k, v = random_kv(1, H, 100, D)
    cache = RotatingKVCache(64, checkpoint_every=16)
    feed(cache, k, v, [100])
    assert cache.checkpoints
    pointers = set()
    for _ in range(5):
        cache.update_and_fetch(*random_kv(1, H, 1, D))
        mx.eval(cache.keys)
        pointers.add(data_pointer(cache.keys))
    assert len(pointers) == 1


@pytest.mark.parametrize("quantized,keep", [(False, 0), (False, 4), (True, 0)])
def test_batch_rows_take_out_their_own_checkpoints(quantized, keep):
    """``extract`` gives each row the checkpoints of its own tokens: what a
    single ring fed that row up to the position holds; ``filter`` keeps
    them with their rows."""
    mx.random.seed(0)
    pad = [0, 30, 0]  # rows of 150, 120 and 150 real tokens
    ks, vs = random_kv(3, H, 150, D)
    cache = BatchRotatingKVCache(48, pad, keep, checkpoint_every=32)
    if quantized:
        cache = cache.to_quantized(group_size=32, bits=8)
    feed(cache, ks, vs, [40, 60, 50])
    cache.filter([1, 2])
    for row, b in ((0, 1), (1, 2)):
        taken = cache.extract(row).checkpoints
        assert [c.offset for c in taken] == [
            t - pad[b] for t in (64, 96, 128) if t - pad[b] > 0
        ]
        for c in taken:
            alone = ring("quantized" if quantized else "ring", 48, keep)
            at = pad[b]
            feed(alone, ks[b : b + 1, :, at:], vs[b : b + 1, :, at:], [c.offset])
            assert same(temporal(c), temporal(alone))


def test_a_row_and_the_checkpoints_it_takes_out_cost_one_sync(monkeypatch):
    """``extract`` syncs once, for the row's and the batch's checkpoints'
    offsets together (later evals find them done), and schedules what it
    copies without waiting: a server extracts every layer of a segment
    before its first token."""
    mx.random.seed(0)
    ks, vs = random_kv(2, H, 150, D)
    cache = BatchRotatingKVCache(48, [0, 20], checkpoint_every=32)
    feed(cache, ks, vs, [150])
    assert len(cache.checkpoints) == 4
    calls = []
    for name in ("eval", "async_eval"):

        def record(*a, _name=name, _fn=getattr(mx, name)):
            calls.append((_name, {id(x) for _, x in tree_flatten(a)}))
            return _fn(*a)

        monkeypatch.setattr(mx, name, record)
    offsets = {
        id(x) for c in (cache, *cache.checkpoints) for x in (c.offset, c.left_padding)
    }
    taken = cache.extract(1).checkpoints
    assert [c.offset for c in taken] == [12, 44, 76, 108]
    assert calls[0] == ("eval", offsets)
    assert calls[-1][0] == "async_eval"
    assert all(held <= offsets for name, held in calls if name == "eval")


def test_the_checkpoints_offsets_are_evaluated_with_the_ring():
    """The offsets of the checkpoints a chunk takes are computed when the
    batch's state is (``PromptProcessingBatch.prompt`` evaluates it after
    every chunk): the sync of ``extract`` finds nothing left to compute,
    where each layer's waited for the device (9-10 ms of an agent's turn
    on an H200, Gemma-3 shape)."""
    import io

    mx.random.seed(0)
    ks, vs = random_kv(2, H, 150, D)
    cache = BatchRotatingKVCache(48, [0, 20], checkpoint_every=32)
    for a, b in ((0, 70), (70, 150)):
        cache.update_and_fetch(ks[:, :, a:b], vs[:, :, a:b])
        mx.eval(cache.state)
    assert len(cache.checkpoints) == 4
    for c in cache.checkpoints:
        dot = io.StringIO()
        mx.export_to_dot(dot, c.offset, c.left_padding)
        assert "label =" not in dot.getvalue()  # no operation left to run


def test_rows_keep_their_checkpoints_when_others_join():
    """A row joining a batch mid-prefill (``extend``) takes checkpoints from
    then on; the rows already there keep theirs: each the single ring fed
    that row up to the position."""
    mx.random.seed(0)
    ks, vs = random_kv(3, H, 200, D)
    cache = BatchRotatingKVCache(48, [0, 0], checkpoint_every=32, max_checkpoints=8)
    feed(cache, ks[:2], vs[:2], [70])
    joining = BatchRotatingKVCache(48, [0], checkpoint_every=32, max_checkpoints=8)
    cache.extend(joining)  # its tokens: ks[2] from column 70 on
    feed(cache, ks[:, :, 70:], vs[:, :, 70:], [60, 70])
    for b, start in ((0, 0), (1, 0), (2, 70)):
        taken = cache.extract(b).checkpoints
        want = [t - start for t in range(32, 193, 32) if t - start > 0]
        assert [c.offset for c in taken] == want
        for c in taken:
            alone = RotatingKVCache(48)
            feed(alone, ks[b : b + 1, :, start:], vs[b : b + 1, :, start:], [c.offset])
            assert same(temporal(c), temporal(alone))


def test_right_padded_rows_keep_checkpoints_within_their_tokens():
    """Rows of 150, 100 and 130 tokens prefilled together (right padding,
    as ``BatchGenerator`` pads a chunk): each row's checkpoints are the
    multiples of 32 within its own tokens, each the single ring fed that
    row that far."""
    mx.random.seed(0)
    lengths = [150, 100, 130]
    ks, vs = random_kv(3, H, 150, D)
    cache = BatchRotatingKVCache(48, [0, 0, 0], checkpoint_every=32)
    cache.prepare(lengths=lengths, right_padding=[150 - n for n in lengths])
    feed(cache, ks, vs, [60, 60, 30])
    cache.finalize()
    for b in range(3):
        taken = cache.extract(b).checkpoints
        assert [c.offset for c in taken] == list(range(32, lengths[b] + 1, 32))
        for c in taken:
            alone = RotatingKVCache(48)
            feed(alone, ks[b : b + 1], vs[b : b + 1], [c.offset])
            assert same(temporal(c), temporal(alone))


FIRST = [(7 * j + 3) % 500 + 10 for j in range(1500)]
SECOND = FIRST[:1200] + [(11 * j + 5) % 500 + 10 for j in range(40)]


def prefill(model, tokens, cache, step=512):
    """Logits of the last token of ``tokens`` prefilled into ``cache``."""
    y = mx.array(tokens)[None]
    while y.shape[1]:
        logits = model(y[:, :step], cache=cache)[:, -1]
        mx.eval(logits, [c.state for c in cache])
        y = y[:, step:]
    return logits


def branch(model, step, every=0):
    """A 1,500-token prompt cached (rings checkpointing every ``every``
    tokens), then one sharing its first 1,200 tokens: the tokens left to
    prefill, and the logits after prefilling them."""
    cache = make_prompt_cache(model, checkpoint_every=every)
    prefill(model, FIRST, cache, step)
    store = LRUPromptCache()
    store.insert_cache("m", FIRST, cache)
    fetched, rest = store.fetch_nearest_cache("m", SECOND)
    fetched = fetched or make_prompt_cache(model, checkpoint_every=every)
    return len(rest), prefill(model, rest, fetched), store


@pytest.mark.parametrize("step", [512, 2048])
def test_a_branch_past_the_window_prefills_from_the_nearest_checkpoint(load_tiny, step):
    """gemma3_text, window 256: without checkpoints all 1,240 tokens are
    prefilled again; with a checkpoint every 512 tokens, the 216 past the
    one at 1,024, and the logits are a fresh prefill's (within 1e-5)."""
    model, _ = load_tiny("gemma3_text", sliding_window=256)
    fresh = prefill(model, SECOND, make_prompt_cache(model))
    left, _, _ = branch(model, step)
    assert left == len(SECOND) == 1240
    left, logits, store = branch(model, step, every=512)
    assert left == 1240 - 1024
    assert mx.allclose(logits, fresh, atol=1e-5, rtol=0).item()


def test_a_cache_restored_from_a_checkpoint_keeps_it_for_the_next_branch(load_tiny):
    """Branching twice from one point (an edit regenerated, then edited
    again): the cache restored from the checkpoint at 1,024 keeps it, so
    the entry it makes serves the next branch from there too, with a fresh
    prefill's logits."""
    model, _ = load_tiny("gemma3_text", sliding_window=256)
    _, _, store = branch(model, 512, every=512)
    fetched, rest = store.fetch_nearest_cache("m", SECOND)
    prefill(model, rest, fetched)
    again = LRUPromptCache()  # only the branch's entry
    again.insert_cache("m", SECOND, fetched)
    third = FIRST[:1100] + [(13 * j + 1) % 500 + 10 for j in range(30)]
    cache, rest = again.fetch_nearest_cache("m", third)
    assert len(rest) == len(third) - 1024
    fresh = prefill(model, third, make_prompt_cache(model))
    got = prefill(model, rest, cache)
    assert mx.allclose(got, fresh, atol=1e-5, rtol=0).item()


def first_logprobs(model, prompts, caches=None, **kwargs):
    """The first prompt's ``BatchGenerator`` response after one token (its
    log-probabilities, cache and tokens), in a batch with the others."""
    from mlx_lm.generate import BatchGenerator

    generator = BatchGenerator(model, max_tokens=1, prefill_step_size=300, **kwargs)
    uids = generator.insert(prompts, caches=caches)
    done = {}
    while len(done) < len(prompts):
        done.update((r.uid, r) for r in generator.next_generated() if r.finish_reason)
    return done[uids[0]]


@pytest.mark.parametrize("kv_bits", [None, 8])
def test_a_batch_row_branches_from_its_checkpoint_with_fresh_logprobs(
    load_tiny, kv_bits
):
    """As the server does it: the first prompt prefilled in a batch (300-token
    chunks, beside a shorter prompt), its row's cache stored; the branch is
    served from the checkpoint at 1,024 and its first token's
    log-probabilities are a fresh batch prefill's (within 1e-5), also with
    quantized rings."""
    model, _ = load_tiny("gemma3_text", sliding_window=256)
    kwargs = {"kv_bits": kv_bits, "kv_group_size": 32, "quantized_kv_start": 0}
    kwargs = kwargs if kv_bits else {}
    other = [(5 * j + 1) % 400 + 10 for j in range(700)]
    rows = [make_prompt_cache(model, checkpoint_every=512) for _ in range(2)]
    done = first_logprobs(model, [FIRST, other], rows, **kwargs)
    store = LRUPromptCache()
    store.insert_cache("m", done.all_tokens, done.prompt_cache)
    fetched, rest = store.fetch_nearest_cache("m", SECOND)
    assert len(rest) == 1240 - 1024
    got = first_logprobs(model, [rest], [fetched], **kwargs).logprobs
    want = first_logprobs(model, [SECOND], **kwargs).logprobs
    assert mx.allclose(got, want, atol=1e-5, rtol=0).item()


def test_the_store_counts_checkpoints_inside_its_byte_budget(load_tiny):
    model, _ = load_tiny("gemma3_text", sliding_window=256)
    cache = make_prompt_cache(model, checkpoint_every=512)
    prefill(model, FIRST, cache)
    rings = [c for c in cache if isinstance(c, RotatingKVCache)]
    taken = [c.checkpoints for c in rings]
    assert [[x.offset for x in t] for t in taken] == [[512, 1024]] * len(rings)
    stores = {"with": LRUPromptCache()}
    stores["with"].insert_cache("m", FIRST, cache)
    for c in rings:
        c.checkpoints = ()
    stores["bare"] = LRUPromptCache()
    stores["bare"].insert_cache("m", FIRST, cache)
    extra = stores["with"].nbytes - stores["bare"].nbytes
    # Two checkpoints, each a whole window as the ring holds it.
    assert extra == sum(x.nbytes for t in taken for x in t)
    assert extra == 2 * sum(c.nbytes for c in rings)
    for c, t in zip(rings, taken):
        c.checkpoints = t
    tight = LRUPromptCache(max_bytes=stores["with"].nbytes - 1)
    tight.insert_cache("m", FIRST, cache)
    assert len(tight) == 0 and tight.nbytes == 0


def agent_loop(model, turns, bits=None):
    """An ``LRUPromptCache`` after an agent loop with a checkpoint every 512
    tokens: a 600-token prompt, then ``turns`` of 300 tokens more, each
    fetched, prefilled and stored."""
    store, tokens = LRUPromptCache(bits=bits), FIRST[:600]
    cache = make_prompt_cache(model, checkpoint_every=512)
    prefill(model, tokens, cache)
    store.insert_cache("m", tokens, cache)
    for turn in range(turns):
        tokens = tokens + [(13 * j + turn) % 500 + 10 for j in range(300)]
        cache, rest = store.fetch_nearest_cache("m", tokens)
        prefill(model, rest, cache)
        store.insert_cache("m", tokens, cache)
    return store


def test_a_conversations_entries_count_the_checkpoints_they_share_once(load_tiny):
    """An agent loop on gemma3_text (window 256, a checkpoint every 512
    tokens): each turn's entry holds the checkpoints of the turns before
    (a fetch hands them on), and the store's ``nbytes`` counts each once:
    the layers' own bytes, the distinct checkpoints' and the shared blocks'
    (before: every entry's checkpoints, 1.28x), so a budget of exactly that evicts
    nothing."""
    model, _ = load_tiny("gemma3_text", sliding_window=256)
    store = agent_loop(model, turns=4)
    keys = [key for q in store._lru._lrus.values() for key in q]
    layers = [c for m, t in keys for c in store._trie.get(m, list(t)).prompt_cache]
    points = [p for c in layers for p in getattr(c, "checkpoints", ())]
    distinct = {id(p): p.nbytes for p in points}
    assert len(keys) == 5 and len(distinct) < len(points)  # shared
    own = sum(c.nbytes for c in layers) - sum(p.nbytes for p in points)
    assert store.nbytes == own + sum(distinct.values()) + store._blocks.nbytes
    store.trim_to(n_bytes=store.nbytes)
    assert len(store) == 5


def test_with_bits_a_conversations_entries_share_their_quantized_checkpoints(
    load_tiny,
):
    """With ``bits``, an entry put at rest quantizes the ring checkpoints it
    shares with the conversation's other entries once: one quantized
    checkpoint a layer and position, and fewer bytes than without ``bits``
    (before, each entry quantized its own: 2.4x the checkpoints' bytes, and
    more bytes in all than bfloat16 entries)."""
    model, _ = load_tiny("gemma3_text", sliding_window=256)
    stores = {bits: agent_loop(model, turns=6, bits=bits) for bits in (None, 8)}
    store = stores[8]
    keys = [key for q in store._lru._lrus.values() for key in q]
    quantized = {
        id(p): (i, p.offset)
        for m, t in keys
        for i, c in enumerate(store._trie.get(m, list(t)).prompt_cache)
        for p in getattr(c, "checkpoints", ())
        if hasattr(p, "bits")
    }
    assert quantized and len(quantized) == len(set(quantized.values()))
    assert store.nbytes < stores[None].nbytes


def test_a_server_regenerating_an_edited_message_prefills_past_the_checkpoint(
    make_tiny_dir,
):
    """Through ``mlx_lm_patched.server`` on 127.0.0.1 (gemma3_text, window
    256): a chat whose long user message is edited near its end reports the
    tokens up to the checkpoint before the edit as cached, and logs a prefill
    of only the rest."""
    from mlx_lm_patched.demo import tiny

    port = free_port()
    model = make_tiny_dir("gemma3_text", sliding_window=256)
    cmd = [
        sys.executable, "-m", "mlx_lm_patched.server", "--model", str(model),
        "--port", str(port), "--max-tokens", "4",
    ]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    words = tiny.TEXT.split()

    def chat(text):
        messages = [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": text},
        ]
        body = json.dumps({"messages": messages, "max_tokens": 4, "temperature": 0})
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            body.encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            return json.loads(r.read())["usage"]

    try:
        for _ in range(600):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        first = chat(" ".join(words[:700]))
        second = chat(" ".join(words[:600] + ["Edited", "here."] + words[620:700]))
    finally:
        server.terminate()
        log = server.communicate(timeout=30)[1].decode()
    assert first["prompt_tokens"] > 512 + 50  # the edit lies past 512 tokens
    cached = second["prompt_tokens_details"]["cached_tokens"]
    assert cached == 512
    left = second["prompt_tokens"] - cached
    totals = re.findall(r"Prompt processing progress: \d+/(\d+)", log)
    assert totals[-1] == str(left)


def test_an_entry_quantized_at_rest_keeps_quantized_checkpoints(load_tiny):
    """``LRUPromptCache(bits=8)`` quantizes the rings' checkpoints with them
    (fewer bytes than the model's dtype) and still branches from the one at
    1,024: the logits are, bit for bit, those of an entry of the first 1,024
    tokens at rest, whose rings hold the same tokens quantized alike."""
    model, _ = load_tiny("gemma3_text", sliding_window=256)
    cache = make_prompt_cache(model, checkpoint_every=512)
    prefill(model, FIRST, cache)
    store = LRUPromptCache(bits=8)
    store.insert_cache("m", FIRST, cache)
    store.trim_to(n_bytes=store.nbytes - 1)  # the newest quantized, not evicted
    rings = [c for c in store._trie.get("m", FIRST).prompt_cache if hasattr(c, "bits")]
    assert len(rings) == sum(isinstance(c, RotatingKVCache) for c in cache)
    assert all([x.offset for x in c.checkpoints] == [512, 1024] for c in rings)
    assert all(hasattr(x, "bits") for c in rings for x in c.checkpoints)
    full = sum(x.nbytes for c in cache for x in getattr(c, "checkpoints", ()))
    assert 0 < sum(x.nbytes for c in rings for x in c.checkpoints) < 0.7 * full
    fetched, rest = store.fetch_nearest_cache("m", SECOND)
    assert len(rest) == 1240 - 1024
    got = prefill(model, rest, fetched)
    short = make_prompt_cache(model)
    prefill(model, FIRST[:1024], short)
    alike = LRUPromptCache(bits=8)
    alike.insert_cache("m", FIRST[:1024], short)
    alike.trim_to(n_bytes=alike.nbytes - 1)
    want = prefill(model, rest, alike.fetch_nearest_cache("m", FIRST[:1024])[0])
    assert mx.array_equal(got, want).item()


def single_rows(kind, lengths, ks, vs, max_size=48):
    """Rings checkpointing every 32 tokens, fed ``lengths`` tokens of the rows
    of ``ks``/``vs`` in chunks of 64."""
    rows = []
    for b, n in enumerate(lengths):
        r = ring(kind, max_size, 0, every=32)
        feed(
            r, ks[b : b + 1], vs[b : b + 1], [64] * (n // 64) + [n % 64] * (n % 64 > 0)
        )
        rows.append(r)
    return rows


def check_row(kind, row, k, v, max_size=48):
    """Each of ``row``'s checkpoints is, bit for bit, a ring fed ``k``/``v``
    that far."""
    for c in row.checkpoints:
        alone = ring(kind, max_size, 0)
        feed(alone, k, v, [c.offset])
        assert same(temporal(c), temporal(alone))


@pytest.mark.parametrize("kind", ["ring", "quantized"])
def test_rows_merged_into_a_batch_keep_the_checkpoints_they_bring(kind):
    """Rings merged into a batch (as a server batches fetched caches) get
    their checkpoints back from ``extract``, with those the batch took
    since: all of them, as ``max_checkpoints`` (8) hold them, each the
    single ring fed that row that far. ``filter`` keeps them with their rows, ``nbytes`` counts
    them."""
    mx.random.seed(0)
    lengths = [150, 100, 0]
    ks, vs = random_kv(3, H, 300, D)
    rows = single_rows(kind, lengths, ks, vs)
    brought = [[c.offset for c in r.checkpoints] for r in rows]
    assert brought == [[32, 64, 96, 128], [32, 64, 96], []]
    batch = rows[0].merge(rows)
    assert batch.nbytes > sum(x.nbytes for r in rows for x in r.checkpoints)
    order = [1, 0, 2]
    batch.filter(order)
    # 60 more tokens a row: the batch's own checkpoints at columns 64 and
    # 96, where row b (its window ends at column 48) is at 16 and 48 past it.
    k, v = (
        mx.concatenate([x[b : b + 1, :, lengths[b] :][..., :60, :] for b in order])
        for x in (ks, vs)
    )
    batch.update_and_fetch(k, v)
    for row, b in enumerate(order):
        out = batch.extract(row)
        want = brought[b] + [lengths[b] + 16, lengths[b] + 48]
        assert [c.offset for c in out.checkpoints] == want
        check_row(kind, out, ks[b : b + 1], vs[b : b + 1])


@pytest.mark.parametrize("kind", ["ring", "quantized"])
def test_batches_joined_or_quantized_lose_no_rows_checkpoints(kind):
    """``extend`` (a batch joining another, as ``BatchGenerator`` joins new
    prompts) and ``to_quantized`` (``--kv-bits`` past its start) keep every
    row's checkpoints, those it brought and those its batch took."""
    mx.random.seed(0)
    ks, vs = random_kv(4, H, 300, D)
    first = single_rows(kind, [150, 100], ks, vs)
    first = first[0].merge(first)
    k, v = (
        mx.concatenate([x[b : b + 1, :, n : n + 40] for b, n in ((0, 150), (1, 100))])
        for x in (ks, vs)
    )
    first.update_and_fetch(k, v)
    second = BatchRotatingKVCache(48, [0, 0], checkpoint_every=32)
    if kind == "quantized":
        second = second.to_quantized(group_size=32, bits=8)
    feed(second, ks[2:], vs[2:], [64, 36])
    before = [
        [c.offset for c in b.extract(i).checkpoints]
        for b in (first, second)
        for i in range(2)
    ]
    assert all(before) and before[0] != before[2]
    first.extend(second)
    after = [[c.offset for c in first.extract(i).checkpoints] for i in range(4)]
    assert after == before
    for i in range(4):
        check_row(kind, first.extract(i), ks[i : i + 1], vs[i : i + 1])
    if kind == "ring":
        quantized = first.to_quantized(group_size=32, bits=8)
        got = [quantized.extract(i).checkpoints for i in range(4)]
        assert [[c.offset for c in r] for r in got] == before
        assert all(hasattr(c, "bits") for r in got for c in r)


def on_disk(model, directory, every=512):
    """The cache of ``FIRST`` (checkpoints every ``every`` tokens: at 512 and
    1,024), written by a disk tier in ``directory``, closed; the cache and
    the file's path."""
    from mlx_lm.models.prompt_cache_disk import DiskPromptCache

    cache = make_prompt_cache(model, checkpoint_every=every)
    prefill(model, FIRST, cache)
    tier = DiskPromptCache(str(directory))
    tier.put("m", FIRST, cache)
    tier.close()
    (name,) = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    return cache, directory / name


def test_a_disk_entry_branches_from_its_checkpoints_after_a_restart(
    load_tiny, tmp_path
):
    """A disk tier writes the rings' checkpoints in the entry's file: read
    back by another tier on the directory (a restarted server), the branch
    prefills the 216 tokens past the one at 1,024 with a fresh prefill's
    logits (within 1e-5), keeping both, and the whole entry has both, bit
    for bit."""
    from mlx_lm.models.prompt_cache_disk import DiskPromptCache

    model, _ = load_tiny("gemma3_text", sliding_window=256)
    cache, _ = on_disk(model, tmp_path)
    fresh = prefill(model, SECOND, make_prompt_cache(model))
    tier = DiskPromptCache(str(tmp_path))
    fetched, rest = tier.get("m", SECOND)
    assert len(rest) == 1240 - 1024
    rings = [i for i, c in enumerate(cache) if isinstance(c, RotatingKVCache)]
    # The restored ring keeps the checkpoint it is (a copy of it: no cycle)
    assert all([c.offset for c in fetched[i].checkpoints] == [512, 1024] for i in rings)
    assert sum(c.nbytes for c in fetched) > sum(c.nbytes for c in cache) / 2
    assert mx.allclose(prefill(model, rest, fetched), fresh, atol=1e-5, rtol=0).item()
    whole, rest = tier.get("m", FIRST + [5])
    assert rest == [5]
    for i in rings:
        pairs = list(zip(whole[i].checkpoints, cache[i].checkpoints))
        assert len(pairs) == 2
        assert all(same(temporal(a), temporal(b)) for a, b in pairs)


def test_a_branch_of_a_disk_entry_reads_its_header_only_to_load_it(
    load_tiny, tmp_path, monkeypatch
):
    """Where an entry's rings all have checkpoints is kept from its write:
    a fetch that branches off it reads the file's header only to load it
    (an agent loop asks it of the last entry every turn; a Gemma-3 header
    with its checkpoints takes ~10 ms to parse); a tier that did not write
    it (a replica, a restart) reads it once, then no more."""
    from mlx_lm.models.prompt_cache_disk import DiskPromptCache

    model, _ = load_tiny("gemma3_text", sliding_window=256)
    cache = make_prompt_cache(model, checkpoint_every=512)
    prefill(model, FIRST, cache)
    writer = DiskPromptCache(str(tmp_path))
    writer.put("m", FIRST, cache)
    writer.flush()
    other = DiskPromptCache(str(tmp_path))
    for tier, looks in ((writer, 0), (other, 1)):
        reads = []
        read = tier._read_header

        def counted(*a, _read=read, _reads=reads, **k):
            _reads.append("fd" in k)  # with an fd: a load
            return _read(*a, **k)

        monkeypatch.setattr(tier, "_read_header", counted)
        for _ in range(2):
            fetched, rest = tier.get("m", SECOND)
            assert len(rest) == 1240 - 1024
        assert reads.count(False) == looks and reads.count(True) == 2


def test_an_entry_written_without_checkpoints_still_loads(load_tiny, tmp_path):
    """A file as the disk tier wrote it before checkpoints were kept (no
    ``ring_checkpoints`` in its header) is served as before: the whole
    prompt, and no branch past the window."""
    from mlx_lm.models.prompt_cache_disk import DiskPromptCache

    model, _ = load_tiny("gemma3_text", sliding_window=256)
    _, path = on_disk(model, tmp_path, every=0)
    assert "0.ring_checkpoints" not in read_header(path)[0]["__metadata__"]
    tier = DiskPromptCache(str(tmp_path))
    assert tier.get("m", FIRST + [5])[1] == [5]
    assert tier.get("m", SECOND) is None


def read_header(path):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def swap_positions(header, layers):
    """The first ring's two checkpoints claim each other's positions."""
    meta = header["__metadata__"]
    held = json.loads(meta["0.ring_checkpoints"])
    held[0][1], held[1][1] = held[1][1], held[0][1]
    meta["0.ring_checkpoints"] = json.dumps(held)


def given_to_full_attention(header, layers):
    """A checkpoint claimed by a layer that is no ring."""
    meta = header["__metadata__"]
    held = json.loads(meta["0.ring_checkpoints"])
    held[0][0] = next(i for i, c in enumerate(layers) if not hasattr(c, "max_size"))
    meta["0.ring_checkpoints"] = json.dumps(held)


@pytest.mark.parametrize("edit", [swap_positions, given_to_full_attention, None])
def test_a_tampered_checkpoint_is_a_miss_never_a_wrong_cache(
    load_tiny, tmp_path, caplog, edit
):
    """A file whose checkpoints were edited, its header resealed (manifest
    recomputed: a crafted file), or one of whose checkpoint bytes flipped
    (``None``), is skipped with a warning: no cache is served, neither a
    branch nor the whole prompt."""
    from mlx_lm.models.prompt_cache_disk import DiskPromptCache

    model, _ = load_tiny("gemma3_text", sliding_window=256)
    cache, path = on_disk(model, tmp_path)
    header, body = read_header(path)
    if edit is None:  # a byte of the last array, a checkpoint's
        last = max(
            (v["data_offsets"] for k, v in header.items() if k != "__metadata__")
        )
        body = bytearray(body)
        body[last[0] + 1] ^= 0x40
    else:
        edit(header, cache)
        header["__metadata__"]["0.manifest"] = DiskPromptCache._manifest(header)
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(body))
    caplog.set_level(logging.WARNING)
    tier = DiskPromptCache(str(tmp_path))
    assert len(tier) == 1  # indexed: its header is sound
    assert tier.get("m", SECOND) is None
    assert tier.get("m", FIRST + [5]) is None  # not even the whole prompt
    assert f"skipping {path}" in caplog.text
