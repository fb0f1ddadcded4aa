"""BatchGenerator(kv_bits=...): batched rows quantize when their single
streams do and give their tokens."""

import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, batch_generate
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from ringref import PROMPTS, single_stream

from mlx_lm_patched.demo import tiny


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


@pytest.mark.parametrize("max_kv_size", [None, 256])
def test_the_call_that_quantizes_a_batch_holds_no_layer_s_full_precision_cache(
    patched, exact_active_memory, max_kv_size, monkeypatch
):
    """A prefill chunk that takes the caches to ``quantized_kv_start``
    attends over its update in full precision but keeps each layer's
    quantized copy only: its peak is below the bfloat16 batch's by at least
    half its 16 layers' bfloat16 caches (holding them to the end of the
    call, it is above it: 22.4 against 21.8 layers' worth). With a ring the
    chunk runs past it, and the quantized ring packs its keys. The tiny
    model's 300-token chunk is pipelined as a long one."""
    monkeypatch.setattr(sys.modules["mlx_lm.models.ring_buffer"], "PIPELINE_MIN", 256)
    config = tiny.model_config(
        "llama", num_hidden_layers=16, head_dim=128, num_key_value_heads=2
    )
    model = tiny.build_model(config, dtype="bfloat16")
    prompts = [list(range(1, 301)), list(range(2, 302))]

    def first_chunk_peak(**kw):
        gen = BatchGenerator(
            model, max_tokens=1, prefill_step_size=512, max_kv_size=max_kv_size, **kw
        )
        mx.synchronize()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        gen.insert(prompts)
        gen.next_generated()
        peak = mx.get_peak_memory() - before
        gen.close()
        return peak

    bf16 = first_chunk_peak()
    quantized = first_chunk_peak(kv_bits=4, quantized_kv_start=0)
    columns = max_kv_size or 512
    layer = 2 * 2 * 2 * columns * 128 * 2  # keys and values of 2 rows
    assert quantized < bf16 - 8 * layer
