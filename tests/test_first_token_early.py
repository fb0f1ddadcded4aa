"""GenerationBatch.next: a row's first token before the next step is encoded."""

import pytest
from mlx_lm.generate import BatchGenerator, batch_generate
from ringref import PROMPTS

import mlx_lm_patched


class Counted:
    """``model``, counting its one-token calls (a decode step each)."""

    def __init__(self, model):
        self.model, self.decode_calls = model, 0

    def __call__(self, inputs, *args, **kwargs):
        self.decode_calls += inputs.shape[1] == 1
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("patch", [True, False])
def test_a_row_s_first_token_comes_back_with_one_step_encoded(load_tiny, patch):
    """When ``next`` gives a row's first token, the step that made it is the
    only decode step encoded (upstream encodes the one after it too); the
    next call encodes the held step and its own."""
    model, _ = load_tiny("gemma3_text")
    if not patch:
        mlx_lm_patched.revert("first_token_early")
    counted = Counted(model)
    gen = BatchGenerator(counted)
    gen.insert([PROMPTS[0]], max_tokens=[4])
    seen = []
    while not seen:
        seen = gen.next()[1]
    assert counted.decode_calls == (1 if patch else 2)
    assert len(gen.next()[1]) == 1 and counted.decode_calls == 3


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_batched_tokens_are_the_same_with_first_tokens_early(load_tiny, family):
    """``batch_generate`` (rows joining a decoding batch, finishing apart,
    one at its first token) gives the same tokens with and without it."""
    model, tokenizer = load_tiny(family)
    prompts = PROMPTS + [PROMPTS[1][:5]]
    kw = dict(return_token_ids=True, completion_batch_size=2, prefill_batch_size=1)
    kw["max_tokens"] = [12, 5, 9, 1]
    early = batch_generate(model, tokenizer, prompts, **kw).token_ids
    mlx_lm_patched.revert("first_token_early")
    assert early == batch_generate(model, tokenizer, prompts, **kw).token_ids


def test_a_row_finishing_or_removed_at_its_first_token_has_its_whole_cache(
    load_tiny,
):
    """A row done at its first token gives a cache holding every token it
    returns (the held step encoded first), and a row removed while its
    first token is held leaves the others decoding."""
    model, _ = load_tiny("llama")
    gen = BatchGenerator(model, completion_batch_size=4)
    uids = gen.insert([PROMPTS[0], PROMPTS[1]], max_tokens=[1, 6])
    done = []
    while not done:
        done = [r for r in gen.next()[1] if r.finish_reason]
    (r,) = done
    assert r.uid == uids[0] and r.prompt_cache[0].offset == len(r.all_tokens)
    assert len(r.all_tokens) == len(PROMPTS[0]) + 1
    gen = BatchGenerator(model, completion_batch_size=4)
    uids = gen.insert([PROMPTS[0], PROMPTS[2]], max_tokens=[6, 6])
    while not gen.next()[1]:
        pass
    gen.remove([uids[0]])
    tokens = [r.token for _ in range(5) for r in gen.next()[1]]
    assert len(tokens) == 5
