"""PromptProcessingBatch.split: a split of every row moves the batch."""

import pytest
from mlx_lm.generate import PromptProcessingBatch, batch_generate
from mlx_lm.models.cache import make_prompt_cache
from ringref import PROMPTS

import mlx_lm_patched


def prompt_batch(model, n):
    """A prompt batch of ``n`` rows of different lengths, prefilled."""
    rows = [PROMPTS[i % len(PROMPTS)][: 20 + 7 * i] for i in range(n)]
    batch = PromptProcessingBatch(
        model,
        list(range(n)),
        [make_prompt_cache(model) for _ in rows],
        samplers=[None] * n,
        logits_processors=[[] for _ in rows],
    )
    batch.prompt(rows)
    return batch


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_split_of_every_row_hands_the_caches_over(patched, load_tiny, family):
    """Every row going (a server's request finishing its prompt alone), the
    new batch holds the very caches, neither copied nor gathered, and the
    batch is left empty, as filtered to no rows; some rows going, each side
    gets caches of its own rows."""
    model, _ = load_tiny(family)
    batch = prompt_batch(model, 2)
    caches = list(batch.prompt_cache)
    moved = batch.split([1, 0])
    assert moved.uids == [0, 1] and len(batch) == 0
    assert all(a is b for a, b in zip(moved.prompt_cache, caches))
    assert batch.prompt_cache == [] and batch.tokens == [] and batch.samplers == []
    batch = prompt_batch(model, 3)
    caches = list(batch.prompt_cache)
    some = batch.split([1])
    assert some.uids == [1] and batch.uids == [0, 2]
    assert not any(a is b for a, b in zip(some.prompt_cache, caches))
    assert [c.offset.shape[0] for c in some.prompt_cache] == [1] * len(caches)


def test_batched_tokens_are_the_same_with_the_batch_moved(patched, load_tiny):
    """``batch_generate`` (prompts finishing together and apart) gives the
    same tokens with and without the move."""
    model, tokenizer = load_tiny("gemma3_text")
    kw = dict(max_tokens=12, return_token_ids=True)
    moved = batch_generate(model, tokenizer, PROMPTS, **kw).token_ids
    mlx_lm_patched.revert("prompt_batch_split")
    copied = batch_generate(model, tokenizer, PROMPTS, **kw).token_ids
    assert moved == copied
