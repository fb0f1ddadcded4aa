"""--draft-model with a bounded cache: the same greedy tokens as without it."""

import pytest

import mlx_lm_patched  # noqa: F401  (the fixtures apply or revert it)

PROMPT = list(range(3, 40))


def tokens(model, tokenizer, draft=None, **kwargs):
    from mlx_lm import stream_generate

    gen = stream_generate(
        model, tokenizer, PROMPT, max_tokens=120, draft_model=draft, **kwargs
    )
    return [r.token for r in gen]


@pytest.mark.parametrize("family, max_kv_size", [("gemma3_text", None), ("llama", 48)])
def test_draft_gives_the_no_draft_tokens_with_a_bounded_cache(
    load_tiny, patched, family, max_kv_size
):
    model, tokenizer = load_tiny(family)
    draft, _ = load_tiny(family, seed=1)  # rejects some drafts: trims
    want = tokens(model, tokenizer, max_kv_size=max_kv_size)
    for n in (1, 3):
        got = tokens(
            model, tokenizer, draft, max_kv_size=max_kv_size, num_draft_tokens=n
        )
        assert got == want
    if max_kv_size:  # the bound is kept: it changes the tokens
        assert want != tokens(model, tokenizer)


def test_upstream_draft_drifts_once_a_sliding_window_wraps(load_tiny, upstream):
    model, tokenizer = load_tiny("gemma3_text")
    draft, _ = load_tiny("gemma3_text", seed=1)
    want = tokens(model, tokenizer)
    assert tokens(model, tokenizer, draft, num_draft_tokens=3) != want


def test_more_draft_tokens_than_a_ring_holds_raise(load_tiny, patched):
    model, tokenizer = load_tiny("llama")
    with pytest.raises(ValueError, match="num_draft_tokens 50 does not fit"):
        tokens(model, tokenizer, model, max_kv_size=48, num_draft_tokens=50)


@pytest.mark.parametrize("family, max_kv_size", [("gemma3_text", None), ("llama", 48)])
def test_draft_with_kv_bits_gives_the_no_draft_tokens_on_a_quantized_ring(
    load_tiny, patched, family, max_kv_size
):
    """Quantized from the first token: a draft model verifies in chunks, so
    a later ``quantized_kv_start`` converts the cache a few tokens apart."""
    model, tokenizer = load_tiny(family)
    draft, _ = load_tiny(family, seed=1)
    kw = dict(max_kv_size=max_kv_size, kv_bits=4, kv_group_size=32)
    want = tokens(model, tokenizer, quantized_kv_start=0, **kw)
    assert want != tokens(model, tokenizer, max_kv_size=max_kv_size)  # quantized
    for n in (1, 3):
        got = tokens(
            model, tokenizer, draft, num_draft_tokens=n, quantized_kv_start=0, **kw
        )
        assert got == want
