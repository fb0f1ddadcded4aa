"""Host export: ``prompt_cache_to_host`` snapshots on the generating thread,
``HostPromptCache.save`` writes on another while generation goes on. Files
and snapshots load back bit-exactly (bfloat16 and quantized caches too);
tokens are unchanged."""

import queue
import threading

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import (
    KVCache,
    QuantizedKVCache,
    load_prompt_cache,
    make_prompt_cache,
    prompt_cache_from_host,
    prompt_cache_to_host,
    save_prompt_cache,
)
from ringref import random_kv, same

pytestmark = pytest.mark.usefixtures("patched")

STEPS, EVERY = 96, 8


def flat_state(cache):
    """Every array and scalar of a prompt cache's state, in order."""
    out = []

    def walk(x):
        if isinstance(x, (list, tuple)):
            for y in x:
                walk(y)
        else:
            out.append(x)

    walk([c.state for c in cache])
    return out


def bit_equal(a, b):
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if isinstance(x, mx.array) != isinstance(y, mx.array):
            return False
        if isinstance(x, mx.array):
            if x.dtype != y.dtype or x.shape != y.shape:
                return False
            # Compare bits, not values: NaN payloads and -0.0 count too.
            view = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}
            bits = view[x.dtype.size]
            if x.size and not mx.array_equal(x.view(bits), y.view(bits)).item():
                return False
        elif x != y:
            return False
    return True


def generate(model, prompt, kv_bits, on_step=None):
    """Greedy tokens of ``STEPS`` steps; ``on_step(i, cache)`` after each."""
    cache = make_prompt_cache(model)
    steps = generate_step(
        prompt,
        model,
        max_tokens=STEPS,
        prompt_cache=cache,
        kv_bits=kv_bits,
        quantized_kv_start=0,
    )
    tokens = []
    for i, (token, _) in enumerate(steps):
        tokens.append(int(token))
        if on_step:
            on_step(i, cache)
    return tokens


@pytest.mark.parametrize(
    "family, kv_bits",
    [("llama_sliding", None), ("llama", 8), ("llama", 4)],
    ids=["rotating", "quantized8", "quantized4"],
)
def test_snapshots_written_on_another_thread_during_generation_load_bit_exactly(
    load_tiny, tmp_path, family, kv_bits
):
    model, _ = load_tiny(family)
    prompt = mx.array([(7 * i + 3) % 500 for i in range(90)])
    plain = generate(model, prompt, kv_bits)

    # The same generation, a snapshot every EVERY steps written meanwhile by
    # a writer thread.
    jobs, snapshots, errors = queue.Queue(), {}, []

    def writer():
        while (job := jobs.get()) is not None:
            i, host = job
            try:
                host.save(str(tmp_path / f"host{i}.safetensors"))
            except Exception as e:  # reported on the main thread
                errors.append(e)

    def export(i, cache):
        if i % EVERY == 0:
            snapshots[i] = host = prompt_cache_to_host(cache, {"step": str(i)})
            jobs.put((i, host))

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        exported = generate(model, prompt, kv_bits, export)
    finally:
        jobs.put(None)
        thread.join()
    assert errors == []
    assert exported == plain

    # A third run saves synchronously with mlx-lm's own save at the same steps.
    def save(i, cache):
        if i % EVERY == 0:
            save_prompt_cache(str(tmp_path / f"sync{i}.safetensors"), cache)

    assert generate(model, prompt, kv_bits, save) == plain
    assert sorted(snapshots) == list(range(0, STEPS, EVERY))
    for i, host in snapshots.items():
        loaded, meta = load_prompt_cache(
            str(tmp_path / f"host{i}.safetensors"), return_metadata=True
        )
        assert meta == {"step": str(i)}
        kind = "QuantizedKVCache" if kv_bits else "RotatingKVCache"
        assert kind in {type(c).__name__ for c in loaded}
        expected = flat_state(load_prompt_cache(str(tmp_path / f"sync{i}.safetensors")))
        assert [type(c) for c in loaded] == [
            type(c) for c in prompt_cache_from_host(host)
        ]
        assert bit_equal(flat_state(loaded), expected)
        assert bit_equal(flat_state(prompt_cache_from_host(host)), expected)


def filled(bits, *counts):
    """A quantized cache and a ``KVCache`` of bfloat16 tokens."""
    caches = [QuantizedKVCache(bits=bits), KVCache()]
    for c, n in zip(caches, counts):
        c.update_and_fetch(*random_kv(1, 2, n, 64, dtype=mx.bfloat16))
    return caches


def test_host_snapshot_round_trips_bfloat16_bit_exactly_through_numpy():
    caches = filled(8, 40, 33)
    host = prompt_cache_to_host(caches, {"model": "tiny"})
    assert all(
        isinstance(a, np.ndarray) and a.flags.owndata for a in host.arrays.values()
    )
    assert "bfloat16" in host.dtypes.values()
    # The snapshot is a copy: later updates do not reach it.
    caches[0].update_and_fetch(*random_kv(1, 2, 2, 64, dtype=mx.bfloat16))
    restored, meta = prompt_cache_from_host(host, return_metadata=True)
    assert meta == {"model": "tiny"} and restored[0].offset == 40
    caches[0].trim(2)
    assert same(restored[0].state, caches[0].state)
    assert same(restored[1].keys, caches[1].keys)


def test_host_snapshot_written_by_another_thread_loads_bit_exactly(tmp_path):
    caches = filled(4, 50, 17)
    host = prompt_cache_to_host(caches)
    path = str(tmp_path / "spill.safetensors")
    writer = threading.Thread(target=host.save, args=(path,))
    writer.start()
    writer.join()
    loaded = load_prompt_cache(path)
    assert same(loaded[0].state, caches[0].state)
    q = loaded[0]
    assert (q.group_size, q.bits, q.dtype, q.head_dims) == (64, 4, "bfloat16", (64, 64))
    assert same(loaded[1].state, caches[1].state)
