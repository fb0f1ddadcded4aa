"""BatchRotatingKVCache rows move between batches whole: ``merge`` keeps
each row's ``keep`` and ``slack``, ``extract`` returns a row that owns its
memory, holds the row's tokens and trims back what its slack held."""

import random

import mlx.core as mx
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.models.cache import (
    BatchRotatingKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from ringref import random_kv

import mlx_lm_patched


def test_extracted_row_owns_its_memory():
    mx.synchronize()
    before = mx.get_active_memory()
    cache = BatchRotatingKVCache(256, left_padding=[0, 0, 0, 0])
    cache.update_and_fetch(*random_kv(4, 2, 200, 64))
    mx.eval(cache.keys, cache.values)
    row = cache.extract(1)
    mx.eval(row.keys, row.values)
    del cache
    # 2 arrays x 2 heads x 200 tokens x 64 x 4 bytes, and the batch is gone.
    assert row.nbytes == 2 * 2 * 200 * 64 * 4
    assert mx.get_active_memory() - before <= row.nbytes + (64 << 10)


def test_extract_of_an_empty_batch_is_an_empty_cache():
    row = BatchRotatingKVCache(16, left_padding=[1, 0]).extract(0)
    assert row.empty() and row.offset == 0


def holds(cache, tokens):
    """Whether ``cache``'s ring (keys are token ids) holds what a ring fed
    ``tokens`` holds, in temporal order from ``_idx``."""
    ring = cache.keys[0, 0, :, 0].astype(mx.int32).tolist()
    if cache.offset <= cache.max_size:
        return ring[: cache.offset] == tokens
    keep, window = cache.keep, cache.max_size - cache.keep
    idx = keep if cache._idx == cache.max_size else cache._idx
    return (
        ring[:keep] == tokens[:keep] and ring[idx:] + ring[keep:idx] == tokens[-window:]
    )


def test_rows_extracted_after_a_wrap_trim_back_their_slack_exactly():
    rng, trims = random.Random(1), 0
    for _ in range(100):
        max_size = rng.randint(6, 16)
        keep = min(rng.choice([0, 2, 4]), max_size - 1)
        slack = rng.randint(1, max_size - keep)
        rows, nxt, caches = rng.randint(1, 3), 1, []
        for _ in range(rows):
            n = rng.randint(1, 2 * max_size)
            caches.append(
                (list(range(nxt, nxt + n)), RotatingKVCache(max_size, keep, slack))
            )
            caches[-1][1].update_and_fetch(
                *[mx.array(caches[-1][0], mx.float32).reshape(1, 1, n, 1)] * 2
            )
            nxt += n
        batch = BatchRotatingKVCache.merge([c for _, c in caches])
        steps = rng.randint(2 * slack, 3 * max_size)
        for _ in range(steps):
            new = list(range(nxt, nxt + rows))
            nxt += rows
            batch.update_and_fetch(
                *[mx.array(new, mx.float32).reshape(rows, 1, 1, 1)] * 2
            )
            for (tokens, _), t in zip(caches, new):
                tokens.append(t)
        for r, (tokens, _) in enumerate(caches):
            row = batch.extract(r)
            assert holds(row, tokens)
            if row.offset > max_size:
                assert row.trimmable_tokens() >= slack
                trims += 1
            n = min(slack, row.offset)
            assert row.trim(n) == n and holds(row, tokens[: len(tokens) - n])
    assert trims > 50


def random_prompt(n):
    # Fixed, whatever ran before: batched rows attend through masks and
    # padding, so a prompt whose logits nearly tie could flip a row by an ulp.
    return mx.random.randint(0, 512, (n,), key=mx.random.key(n)).tolist()


def test_batched_rows_with_keep_equal_their_single_streams(load_tiny, patched):
    """qwen3 has no make_cache: ``max_kv_size`` gives RotatingKVCache(keep=4),
    which upstream's batch cache ignores (its rows diverge)."""
    model, tokenizer = load_tiny("qwen3")
    prompts = [random_prompt(n) for n in (40, 150, 300)]

    def run():
        batch = batch_generate(
            model,
            tokenizer,
            prompts,
            max_tokens=100,
            max_kv_size=64,
            prefill_step_size=64,
            return_token_ids=True,
        )
        singles = []
        for p in prompts:
            cache = make_prompt_cache(model, max_kv_size=64)
            steps = generate_step(
                mx.array(p), model, prompt_cache=cache, prefill_step_size=64
            )
            singles.append([int(t) for (t, _), _ in zip(steps, range(100))])
        return batch.token_ids, singles

    ours, singles = run()
    assert ours == singles
    mlx_lm_patched.revert()
    theirs, singles = run()
    assert theirs != singles
