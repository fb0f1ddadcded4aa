"""server_token_logprob: the server reads a token's logprob only for a
request that asks for logprobs (a read waits for the GPU's next decode
step); a request that asks gets upstream's values."""

import threading

import pytest
from ringref import cli_args, generation_args

import mlx_lm_patched


def served(model_dir, seed):
    """Two requests (decoding together in the batch; one at a time with a
    ``seed``, through ``_serve_single``), the first with ``logprobs`` and 3
    top logprobs: each one's tokens, logprobs and top logprobs
    as the server hands them to its HTTP handler."""
    from mlx_lm.models.cache import LRUPromptCache
    from mlx_lm.server import CompletionRequest, ModelProvider, ResponseGenerator

    args = cli_args(model_dir)
    args.warmup_tokens = 0
    generator = ResponseGenerator(ModelProvider(args), LRUPromptCache())
    out = [[], []]

    def ask(i, prompt):
        gen = generation_args(12)
        gen.seed = seed
        if i == 0:
            gen.logprobs, gen.top_logprobs = True, 3
        _, responses = generator.generate(
            CompletionRequest("text", prompt, [], None, None), gen
        )
        out[i] = [(r.token, r.logprob, r.top_tokens) for r in responses]

    threads = [
        threading.Thread(target=ask, args=(i, p))
        for i, p in enumerate(["Count with me: one two", "The cat sat on"])
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        generator.stop_and_join()
    return out


@pytest.mark.parametrize("seed", [None, 0])
def test_a_token_logprob_is_read_only_where_asked_with_upstreams_values(
    patched, make_tiny_dir, seed
):
    """The request with logprobs gets upstream's (the patch reverted) for
    every token; the one without gets None in their place, nothing read, and
    the same tokens."""
    model_dir = make_tiny_dir("llama")
    asked, alone = served(model_dir, seed)
    mlx_lm_patched.revert("server_token_logprob")
    theirs, their_alone = served(model_dir, seed)
    assert len(asked) == 12 and asked == theirs
    assert all(isinstance(logprob, float) for _, logprob, _ in asked)
    assert [t for t, _, _ in alone] == [t for t, _, _ in their_alone]
    assert all(logprob is None for _, logprob, _ in alone)
    assert all(isinstance(logprob, float) for _, logprob, _ in their_alone)
