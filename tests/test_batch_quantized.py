"""Batched quantized caches: BatchGenerator(kv_bits=...) rows equal their single streams."""

import copy
import inspect
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, batch_generate, generate_step
from mlx_lm.models import cache as cache_module
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    load_prompt_cache,
    save_prompt_cache,
)

PROMPTS = [list(range(1, 30)), list(range(5, 17)), list(range(40, 90))]


def make_prompt_cache(model, max_kv_size=None):
    return cache_module.make_prompt_cache(model, max_kv_size)


def random_kv(*shape):
    return mx.random.normal(shape), mx.random.normal(shape)


def same(a, b):
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, mx.array):
        return a.shape == b.shape and mx.array_equal(a, b).item()
    return a == b


def single(model, prompt, steps, cache=None, max_kv_size=None, **kwargs):
    """Greedy tokens of one stream, and its cache."""
    cache = make_prompt_cache(model, max_kv_size) if cache is None else cache
    gen = generate_step(
        mx.array(prompt), model, max_tokens=steps, prompt_cache=cache, **kwargs
    )
    return [t for t, _ in gen], cache


def quantized(n, bits=8, seed=0):
    mx.random.seed(seed)
    c = QuantizedKVCache(group_size=64, bits=bits)
    if n:
        c.update_and_fetch(*random_kv(1, 2, n, 64))
    return c


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
        want, cache = single(model, prompt, 40, **kw)
        # A row stops at the end of sequence token, a single stream goes on.
        assert tokens == want[: len(tokens)]
        assert len(tokens) == 40 or want[len(tokens)] in tokenizer.eos_token_ids
        assert [type(c) for c in caches] == [type(c) for c in cache]
        assert all(hasattr(c, "bits") for c in caches)


def test_quantized_prompt_caches_can_be_batched(patched, load_tiny):
    model, tokenizer = load_tiny("llama")
    kw = dict(kv_bits=8, quantized_kv_start=0)
    caches = [single(model, p, 1, **kw)[1] for p in PROMPTS]
    assert {type(c) for cache in caches for c in cache} == {QuantizedKVCache}
    more = [[7, 8, 9], [3], [11, 12]]
    out = batch_generate(
        model, tokenizer, more, prompt_caches=copy.deepcopy(caches),
        max_tokens=30, return_token_ids=True, **kw,
    )  # fmt: skip
    for p, cache, tokens in zip(more, caches, out.token_ids):
        assert tokens == single(model, p, 30, cache=cache, **kw)[0]


def test_upstream_cannot_batch_quantized_prompt_caches(upstream, load_tiny):
    model, tokenizer = load_tiny("llama")
    with pytest.raises(ValueError, match="does not yet support batching"):
        batch_generate(model, tokenizer, [[1, 2]], prompt_caches=[[quantized(5)] * 4])
    assert "kv_bits" not in inspect.signature(BatchGenerator).parameters


def test_merge_then_extract_gives_each_cache_back_bit_exact(patched):
    caches = [quantized(n, seed=n) for n in (7, 0, 19)]
    batch = QuantizedKVCache.merge(caches)
    assert type(batch).__name__ == "BatchQuantizedKVCache"
    assert batch.offset.tolist() == [7, 0, 19] and batch.size() == 19
    for i, c in enumerate(caches):
        row = batch.extract(i)
        assert type(row) is QuantizedKVCache and row.offset == c.offset
        if c.offset:
            assert same(row.keys_and_values(), c.keys_and_values())
            assert (row.dtype, row.head_dims) == (c.dtype, c.head_dims)


def test_upstream_merges_quantized_caches_into_an_empty_cache(upstream):
    assert BatchKVCache.merge([quantized(7), quantized(3)]).keys is None


def test_batch_kv_cache_merge_of_quantized_caches_is_quantized(patched):
    batch = BatchKVCache.merge([KVCache(), quantized(5)])
    assert type(batch).__name__ == "BatchQuantizedKVCache"
    assert batch.offset.tolist() == [0, 5]


def test_filter_and_extend_keep_rows_bit_exact(patched):
    caches = [quantized(n, seed=n) for n in (4, 9, 6)]
    batch = QuantizedKVCache.merge(caches[:2])
    batch.filter([1])
    batch.extend(QuantizedKVCache.merge(caches[2:]))
    assert batch.offset.tolist() == [9, 6]
    for i, c in enumerate(caches[1:]):
        assert same(batch.extract(i).keys_and_values(), c.keys_and_values())


def test_extend_quantizes_an_unquantized_batch(patched):
    fp = KVCache()
    fp.update_and_fetch(*random_kv(1, 2, 5, 64))
    batch = QuantizedKVCache.merge([quantized(8)])
    batch.extend(KVCache.merge([fp]))
    row = batch.extract(1)
    want = mx.quantize(fp.keys[..., :5, :], 64, 8)
    assert same(row.keys_and_values()[0], tuple(want))


def dequantized(parts, bits=8):
    return mx.dequantize(*parts, group_size=64, bits=bits)


def roundtrip(x, bits=8):
    return dequantized(mx.quantize(x, 64, bits), bits)


def test_attention_sees_the_fp_batch_quantized_through_padding_and_decode(patched):
    fp = BatchKVCache([2, 0])
    q = fp.to_quantized(group_size=64, bits=8)
    for c in (fp, q):
        c.prepare(lengths=[3, 5], right_padding=[2, 0])
    steps = [random_kv(2, 2, 5, 64)] + [random_kv(2, 2, 1, 64) for _ in range(4)]
    for i, (k, v) in enumerate(steps):
        if i == 1:
            fp.finalize(), q.finalize()
        masks = [c.make_mask(k.shape[2], return_array=True) for c in (fp, q)]
        assert same(*masks)
        fk, fv = [mx.array(x) for x in fp.update_and_fetch(k, v)]
        qk, qv = [dequantized(p) for p in q.update_and_fetch(k, v)]
        assert same(qk, roundtrip(fk)) and same(qv, roundtrip(fv))
        assert same(q.offset, fp.offset) and same(q.left_padding, fp.left_padding)
    assert q.trim(2) == 2 and same(q.offset, fp.offset - 2)


def test_batch_quantized_cache_survives_save_and_load_bit_exact(patched, tmp_path):
    batch = QuantizedKVCache.merge([quantized(7), quantized(12, bits=8, seed=1)])
    save_prompt_cache(str(tmp_path / "b.safetensors"), [batch])
    (loaded,) = load_prompt_cache(str(tmp_path / "b.safetensors"))
    assert type(loaded) is type(batch)
    assert same(list(loaded.state), list(batch.state))


def test_batch_generator_takes_kv_bits(patched, load_tiny):
    model, _ = load_tiny("llama")
    gen = BatchGenerator(model, kv_bits=4, kv_group_size=32, quantized_kv_start=7)
    assert (gen.kv_bits, gen.kv_group_size, gen.quantized_kv_start) == (4, 32, 7)
    gen.close()


def test_server_keeps_batching_with_kv_bits(patched):
    from mlx_lm.server import ResponseGenerator

    provider = SimpleNamespace(is_batchable=True, cli_args=SimpleNamespace(kv_bits=8))
    server = SimpleNamespace(model_provider=provider)
    assert ResponseGenerator._is_batchable(server, SimpleNamespace(seed=None))
    # The batch generator the server makes is given its KV quantization.
    source = inspect.getsource(ResponseGenerator._generate)
    call = source[source.index("BatchGenerator(") :]
    call = call[: call.index(")")]
    for arg in ("kv_bits", "kv_group_size", "quantized_kv_start"):
        assert f"{arg}=self.cli_args.{arg}," in call


def test_upstream_server_serves_kv_bits_one_at_a_time(upstream):
    from mlx_lm.server import ResponseGenerator

    provider = SimpleNamespace(is_batchable=True, cli_args=SimpleNamespace(kv_bits=8))
    server = SimpleNamespace(model_provider=provider, cli_args=provider.cli_args)
    assert not ResponseGenerator._is_batchable(server, SimpleNamespace(seed=None))


def ring_batch(lengths, max_size=16, keep=4, dims=64):
    """A BatchRotatingKVCache filled with right-padded prompts of ``lengths``."""
    B, S = len(lengths), max(lengths)
    fp = BatchRotatingKVCache(max_size, [0] * B, keep)
    fp.prepare(lengths=lengths, right_padding=[S - n for n in lengths])
    return fp


def test_quantized_batch_ring_sees_the_fp_ring_quantized_token_by_token(patched):
    fp = ring_batch([5, 9, 3])
    q = fp.to_quantized(group_size=64, bits=8)
    assert type(q).__name__ == "BatchQuantizedRotatingKVCache"
    steps = [9, 1, 1, 7, 1, 20] + [1] * 12
    for i, S in enumerate(steps):
        if i == 1:
            fp.finalize(), q.finalize()
        k, v = random_kv(3, 2, S, 64)
        masks = [c.make_mask(S, window_size=12) for c in (fp, q)]
        assert same(*masks)
        fk, fv = [mx.array(x) for x in fp.update_and_fetch(k, v)]
        qk, qv = [dequantized(p) for p in q.update_and_fetch(k, v)]
        assert same(qk, roundtrip(fk)) and same(qv, roundtrip(fv))
        assert same(q.left_padding, fp.left_padding) and q._idx == fp._idx
    for i in range(3):
        row, want = q.extract(i), fp.extract(i)
        assert type(row).__name__ == "QuantizedRotatingKVCache"
        assert (row.offset, row._idx) == (want.offset, want._idx)
        assert same(dequantized(row.keys), roundtrip(want.keys))


def test_quantized_rings_merge_filter_extend_and_extract_bit_exact(patched):
    rings = []
    for n in (3, 20, 0, 11):
        r = RotatingKVCache(16, keep=4).to_quantized(group_size=64, bits=4)
        if n:
            r.update_and_fetch(*random_kv(1, 2, n, 64))
        rings.append(r)
    batch = type(rings[0]).merge(rings[:2])
    batch.filter([1, 0])
    batch.extend(type(rings[0]).merge(rings[2:]))
    for i, want in enumerate([rings[1], rings[0], rings[2], rings[3]]):
        row = batch.extract(i)
        assert row.offset == want.offset
        if want.offset:
            temporal = [want.to_kv_cache(), row.to_kv_cache()]
            k = [c._temporal_order(c.keys) for c in temporal]
            assert same(*k)


def test_quantized_batch_ring_survives_save_and_load_bit_exact(patched, tmp_path):
    fp = ring_batch([5, 9])
    fp.update_and_fetch(*random_kv(2, 2, 9, 64))
    fp.finalize()
    q = fp.to_quantized(group_size=64, bits=4)
    save_prompt_cache(str(tmp_path / "r.safetensors"), [q])
    (loaded,) = load_prompt_cache(str(tmp_path / "r.safetensors"))
    assert type(loaded) is type(q)
    assert same(list(loaded.state), list(q.state))
    k, v = random_kv(2, 2, 1, 64)
    assert same(
        [dequantized(p, 4) for p in loaded.update_and_fetch(k, v)],
        [dequantized(p, 4) for p in q.update_and_fetch(k, v)],
    )


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


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def complete(port, prompt, out):
    body = json.dumps({"prompt": prompt, "max_tokens": 30, "temperature": 0})
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        body.encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        out[prompt] = json.loads(r.read())


def test_server_with_kv_bits_answers_concurrent_requests_on_localhost(make_tiny_dir):
    port = free_port()
    cmd = [
        sys.executable, "-m", "mlx_lm_patched.server",
        "--model", str(make_tiny_dir("llama_sliding")), "--port", str(port),
        "--kv-bits", "8", "--quantized-kv-start", "0",
    ]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        out = {}
        prompts = ["The key and value cache", "A sliding window keeps", "Tests"]
        threads = [
            threading.Thread(target=complete, args=(port, p, out)) for p in prompts
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(out) == set(prompts)
        assert all(r["usage"]["completion_tokens"] > 0 for r in out.values())
    finally:
        server.terminate()
        stderr = server.communicate(timeout=30)[1].decode()
    assert "generation thread died" not in stderr
