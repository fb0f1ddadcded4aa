"""BatchGenerator(kv_bits=...): batched rows quantize when their single
streams do and give their tokens."""

import pytest
from mlx_lm.generate import BatchGenerator, batch_generate
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from ringref import PROMPTS, single_stream


@pytest.mark.parametrize(
    "family, bits, max_kv_size",
    [
        ("llama", 8, None),
        ("llama", 4, None),
        ("gemma3_text", 4, None),
        ("llama", 8, 40),
    ],
)
def test_batched_rows_equal_their_single_streams_token_for_token(
    patched, load_tiny, family, bits, max_kv_size
):
    model, tokenizer = load_tiny(family)
    kw = dict(kv_bits=bits, quantized_kv_start=0, max_kv_size=max_kv_size)
    out = batch_generate(
        model, tokenizer, PROMPTS, max_tokens=40, return_token_ids=True,
        return_prompt_caches=True, **kw,
    )  # fmt: skip
    for prompt, tokens, caches in zip(PROMPTS, out.token_ids, out.caches):
        want, cache = single_stream(model, prompt, 40, **kw)
        # A row stops at the end of sequence token, a single stream goes on.
        assert tokens == want[: len(tokens)]
        assert len(tokens) == 40 or want[len(tokens)] in tokenizer.eos_token_ids
        assert [type(c) for c in caches] == [type(c) for c in cache]
        assert all(hasattr(c, "bits") for c in caches)


def test_batch_generator_takes_kv_bits(patched, load_tiny):
    model, _ = load_tiny("llama")
    gen = BatchGenerator(model, kv_bits=4, kv_group_size=32, quantized_kv_start=7)
    assert (gen.kv_bits, gen.kv_group_size, gen.quantized_kv_start) == (4, 32, 7)
    gen.close()


@pytest.mark.parametrize("start, quantized", [(60, True), (100, False)])
def test_batch_caches_are_quantized_once_the_longest_row_reaches_the_start(
    patched, load_tiny, start, quantized
):
    model, tokenizer = load_tiny("llama")
    out = batch_generate(
        model, tokenizer, PROMPTS, max_tokens=20, return_prompt_caches=True,
        kv_bits=8, quantized_kv_start=start,
    )  # fmt: skip
    # The longest prompt has 50 tokens: its row passes 60 but not 100.
    kinds = {type(c) for caches in out.caches for c in caches}
    assert kinds == ({QuantizedKVCache} if quantized else {KVCache})


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("start", [0, 3, 30])
@pytest.mark.parametrize("prompt", [[7], list(range(5, 17))], ids=["1", "12"])
def test_a_batch_of_one_quantizes_when_generate_step_does(
    patched, load_tiny, bits, start, prompt
):
    model, tokenizer = load_tiny("llama")
    kw = dict(kv_bits=bits, quantized_kv_start=start)
    out = batch_generate(
        model, tokenizer, [prompt], max_tokens=60, return_token_ids=True, **kw
    )
    want, _ = single_stream(model, prompt, 60, **kw)
    tokens = out.token_ids[0]
    assert tokens == want[: len(tokens)]
    assert len(tokens) == 60 or want[len(tokens)] in tokenizer.eos_token_ids
