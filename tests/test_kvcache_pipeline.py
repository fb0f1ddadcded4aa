"""Unbounded caches, quantized or not, pipeline a long chunk a layer at a time."""

import mlx.core as mx
import pytest
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchQuantizedKVCache,
    KVCache,
    QuantizedKVCache,
)
from ringref import pipeline_calls, same

from mlx_lm_patched.demo import tiny

CACHES = {
    "KVCache": KVCache,
    "BatchKVCache": lambda: BatchKVCache([0]),
    "QuantizedKVCache": lambda: QuantizedKVCache(bits=8),
    "BatchQuantizedKVCache": lambda: BatchQuantizedKVCache([0], bits=8),
}


def small_model():
    config = tiny.model_config("llama", head_dim=64, hidden_size=128)
    return tiny.build_model(config, dtype="bfloat16")


@pytest.mark.parametrize("name", list(CACHES))
def test_long_chunks_are_pipelined_a_layer_at_a_time(monkeypatch, name):
    """Each layer's update of a long chunk is scheduled (its buffers and a
    one-element marker), then waits for the previous layer's marker, never
    for its own; a shorter chunk and a decode step evaluate nothing."""
    model = small_model()
    L = len(model.layers)
    cache = [CACHES[name]() for _ in model.layers]
    calls = pipeline_calls(monkeypatch)
    for n in (300, 255, 1):
        model(mx.arange(n)[None] % 512, cache=cache)
    parts = 6 if "Quantized" in name else 2  # keys and values, or their triples
    scheduled = [s for what, s in calls if what == "async_eval"]
    assert [len(s) for s in scheduled] == [parts + 1] * L
    assert all(s[-1] == (1, 1, 1, 1) for s in scheduled)
    # The buffers, each holding the chunk's 300 columns or more.
    assert all(shape[2] >= 300 for s in scheduled for shape in s[:-1])
    assert [what for what, _ in calls] == ["async_eval"] + ["async_eval", "eval"] * (
        L - 1
    )
    assert all(s == [(1, 1, 1, 1)] for what, s in calls if what == "eval")


@pytest.mark.parametrize("name", ["KVCache", "BatchKVCache"])
def test_a_turn_shorter_than_1024_tokens_runs_lazily_as_upstream_s(monkeypatch, name):
    """A chat or agent turn's chunk is not pipelined: on an H200 a 512-token
    chunk took 13-20 ms longer pipelined, at the same peak memory; a chunk
    of 1,024 tokens is, each layer scheduled."""
    model = small_model()
    cache = [CACHES[name]() for _ in model.layers]
    calls = pipeline_calls(monkeypatch, shortest=None)
    model(mx.arange(1023)[None] % 512, cache=cache)
    assert calls == []
    model(mx.arange(1024)[None] % 512, cache=cache)
    assert sum(what == "async_eval" for what, _ in calls) == len(model.layers)


@pytest.mark.parametrize("name", list(CACHES))
def test_under_compile_a_long_chunk_is_not_pipelined(name):
    """``mx.compile`` cannot evaluate inside its graph: the same output."""
    model = small_model()

    def forward(tokens):
        cache = [CACHES[name]() for _ in model.layers]
        model(tokens[:, :300], cache=cache)
        return model(tokens[:, 300:], cache=cache)

    tokens = mx.arange(600)[None] % 512
    assert same(mx.compile(forward)(tokens), forward(tokens))
