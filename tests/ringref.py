"""Shared test helpers: what attention must see through a rotating cache,
upstream twins to compare, bit-exact comparison, random keys and values.

The reference keeps every token and admits, for a query at absolute position
``q``, the first ``keep`` tokens and the ``window - keep`` newest up to ``q``:
what a ring of ``window`` slots fed token by token holds.
"""

import os
import sys
import tempfile

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import (
    BatchRotatingKVCache,
    RotatingKVCache,
    load_prompt_cache,
    save_prompt_cache,
)

from mlx_lm_patched import _registry

H, D = 2, 4  # heads and head dim of the reference harnesses


def upstream_twin(patch, cls):
    """A subclass of ``cls`` running the upstream methods ``patch`` replaces."""
    originals = {
        t.attr: _registry.get_original(t.owner, t.attr)
        for t in patch.targets
        if t.fingerprint is not None and t.owner.endswith(f":{cls.__name__}")
    }
    return type(f"Upstream{cls.__name__}", (cls,), originals)


def attend(q, k, v, mask):
    """Plain softmax attention; ``mask`` as a cache's ``make_mask`` returns it."""
    scores = q @ k.swapaxes(-1, -2)
    if mask == "causal":
        N, L = q.shape[2], k.shape[2]
        mask = mx.tril(mx.ones((N, L), mx.bool_), k=L - N)
    if isinstance(mask, mx.array):
        scores = mx.where(mask, scores, -1e9)
    return mx.softmax(scores, axis=-1) @ v


def reference_mask(offset, N, window, keep=0):
    """Keys ``[0, offset + N)`` each of the ``N`` queries from ``offset`` sees."""
    q = mx.arange(offset, offset + N)[:, None]
    k = mx.arange(offset + N)[None]
    return (k <= q) & ((k < keep) | (k > q - (window - keep)))


def save_load(cache):
    """``cache`` through ``save_prompt_cache`` and ``load_prompt_cache``."""
    with tempfile.TemporaryDirectory() as d:
        save_prompt_cache(os.path.join(d, "c.safetensors"), [cache])
        (cache,) = load_prompt_cache(os.path.join(d, "c.safetensors"))
    return cache


def random_kv(*shape, dtype=mx.float32):
    return mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype)


def temporal(cache):
    """A ring's live keys and values in temporal order, and its offset."""
    from mlx_lm.models.prompt_cache_entries import _live_state

    return _live_state(cache)[:3]


def same(a, b):
    """Bit-exact equality of arrays (dtype and shape too), of tuples and lists
    of them, and of plain values."""
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, mx.array) and isinstance(b, mx.array):
        return a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()
    return type(a) is type(b) and a == b


# Token prompts of different lengths, for batches.
PROMPTS = [list(range(1, 30)), list(range(5, 17)), list(range(40, 90))]


def single_stream(model, prompt, steps, cache=None, max_kv_size=None, **kwargs):
    """Greedy tokens of one ``generate_step`` stream, and its cache."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model, max_kv_size) if cache is None else cache
    gen = generate_step(
        mx.array(prompt), model, max_tokens=steps, prompt_cache=cache, **kwargs
    )
    return [t for t, _ in gen], cache


def active():
    """Bytes MLX holds once garbage is collected."""
    import gc

    gc.collect()
    return mx.get_active_memory()


def same_mask(fp, q):
    """Equal masks, an fp ring's single-query vector as the quantized ring's row."""
    if isinstance(fp, mx.array) and fp.ndim == 1:
        fp = fp[None]
    return same(fp, q)


def free_port():
    """A free TCP port on 127.0.0.1."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def data_pointer(a):
    return np.frombuffer(memoryview(a), dtype=np.uint8).ctypes.data


def eval_calls(monkeypatch):
    """One item an ``mx.eval`` call from now on (holding none of its arrays)."""
    calls, evaluate = [], mx.eval
    monkeypatch.setattr(
        mx, "eval", lambda *a, **k: calls.append(1) or evaluate(*a, **k)
    )
    return calls


def pipeline_calls(monkeypatch, shortest=256):
    """``(name, shapes)`` of each ``mx.async_eval`` and ``mx.eval`` call from
    now on, in order; the pipeline starts afresh (no previous layer) and
    schedules chunks of ``shortest`` tokens or more (tiny models' rings;
    None: the default)."""
    ring_buffer = sys.modules["mlx_lm.models.ring_buffer"]
    if shortest is not None:
        monkeypatch.setattr(ring_buffer, "PIPELINE_MIN", shortest)
    calls = []
    for name in ("eval", "async_eval"):

        def record(*a, _name=name, _fn=getattr(mx, name), **k):
            calls.append((_name, [getattr(x, "shape", None) for x in a]))
            return _fn(*a, **k)

        monkeypatch.setattr(mx, name, record)
    ring_buffer._previous_layer.clear()
    return calls


def buffers_through(cache, batch, sizes, monkeypatch):
    """Update ``cache`` with float16 chunks of ``sizes``; return the distinct
    (shape, keys pointer, values pointer) seen and the concatenate calls."""
    calls, concatenate = [], mx.concatenate
    monkeypatch.setattr(
        mx, "concatenate", lambda *a, **k: calls.append(1) or concatenate(*a, **k)
    )
    seen = set()
    for S in sizes:
        k, v = random_kv(batch, 2, S, 8)
        out = cache.update_and_fetch(k.astype(mx.float16), v.astype(mx.float16))
        mx.eval(out, cache.keys, cache.values)
        seen.add(
            (cache.keys.shape, data_pointer(cache.keys), data_pointer(cache.values))
        )
    return seen, len(calls)


class Rows:
    """A batch cache and, beside it, every real token of each row."""

    def __init__(self, max_size, lengths, keep=0, window=None):
        self.max_size, self.history, singles = max_size, [], []
        # The newest token needs a slot: at most ``max_size - 1`` first tokens.
        self.keep = min(keep, max_size - 1)
        self.window = window  # a model's window_size, below max_size
        for n in lengths:
            single = RotatingKVCache(max_size, keep)
            k, v = random_kv(1, H, n, D)
            if n:
                single.update_and_fetch(k, v)
            singles.append(single)
            self.history.append((k, v))
        self.cache = BatchRotatingKVCache.merge(singles)

    def check(self, S, lengths=None):
        """One update of ``S`` columns (rows with ``lengths`` right-padded);
        True if every real query's output equals the reference's."""
        return self.check_prefill([S], lengths)

    def check_prefill(self, chunks, lengths=None):
        """``sum(chunks)`` columns in ``chunks``, rows with ``lengths`` real
        tokens right-padded (prepare, the chunks, finalize, as
        ``PromptProcessingBatch.prompt`` does); True if every real query's
        output equals the reference's."""
        B, total = len(self.history), sum(chunks)
        lengths = lengths or [total] * B
        if min(lengths) < total:
            padding = [total - n for n in lengths]
            self.cache.prepare(lengths=lengths, right_padding=padding)
        ok, start = True, 0
        for S in chunks:
            k, v = random_kv(B, H, S, D)
            q = mx.random.normal((B, H, S, D))
            mask = self.cache.make_mask(S, window_size=self.window)
            out = attend(q, *self.cache.update_and_fetch(k, v), mask)
            for b, length in enumerate(lengths):
                n = min(max(length - start, 0), S)  # real queries in the chunk
                if n == 0:
                    continue
                hk, hv = self.history[b]
                offset = hk.shape[2]
                hk = mx.concatenate([hk, k[b : b + 1, :, :n]], axis=2)
                hv = mx.concatenate([hv, v[b : b + 1, :, :n]], axis=2)
                self.history[b] = (hk, hv)
                window = min(self.window or self.max_size, self.max_size)
                mask = reference_mask(offset, n, window, self.keep)
                ref = attend(q[b : b + 1, :, :n], hk, hv, mask)
                ok &= mx.allclose(out[b : b + 1, :, :n], ref, atol=1e-5).item()
            start += S
        self.cache.finalize()
        return ok

    def check_extract(self, b):
        single, (hk, hv) = self.cache.extract(b), self.history[b]
        k, v = random_kv(1, H, 1, D)
        q = mx.random.normal((1, H, 1, D))
        mask = single.make_mask(1, window_size=self.window)
        out = attend(q, *single.update_and_fetch(k, v), mask)
        hk, hv = mx.concatenate([hk, k], axis=2), mx.concatenate([hv, v], axis=2)
        window = min(self.window or self.max_size, self.max_size)
        mask = reference_mask(hk.shape[2] - 1, 1, window, self.keep)
        ref = attend(q, hk, hv, mask)
        return mx.allclose(out, ref, atol=1e-5).item()

    @property
    def B(self):
        return len(self.history)

    def room(self):
        """Columns left until the ring's window is full (0 once it is)."""
        return max(0, self.max_size - self.keep - self.cache._offset)

    def save_load(self):
        self.cache = save_load(self.cache)

    def filter(self, rows):
        self.cache.filter(mx.array(rows))
        self.history = [self.history[i] for i in rows]

    def extend(self, n):
        other = Rows(self.max_size, [n], self.keep, self.window)
        self.cache.extend(other.cache)
        self.history += other.history


def python(*args, env=None):
    """``python *args`` in a subprocess with ``env`` added; asserts exit 0."""
    import os
    import subprocess
    import sys

    env = {**os.environ, **(env or {})}
    done = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    return done


def fake_backend(monkeypatch, name):
    """Make MLX look like it runs ``name`` ("cpu", "cuda", "metal") by default;
    CUDA's chain of quantized attentions starts afresh (no previous layer)."""
    getattr(sys.modules["mlx_lm.models.base"], "_previous_attention", []).clear()
    gpu = name != "cpu"
    monkeypatch.setattr(
        mx, "default_device", lambda: mx.Device(mx.gpu if gpu else mx.cpu)
    )
    monkeypatch.setattr(mx.metal, "is_available", lambda: name == "metal")
    monkeypatch.setattr(mx.cuda, "is_available", lambda: name == "cuda")


def cli_args(model):
    """The server's parsed flags for ``model``, as a test builds its
    ``ModelProvider`` and ``ResponseGenerator`` without the parser."""
    import argparse

    return argparse.Namespace(
        model=str(model), adapter_path=None, draft_model=None,
        trust_remote_code=False, chat_template="", use_default_chat_template=False,
        pipeline=False, num_draft_tokens=3, decode_concurrency=32,
        prompt_concurrency=8, prefill_step_size=2048, kv_bits=None,
        kv_group_size=64, quantized_kv_start=0, prompt_cache_bytes=None,
        chat_template_args={}, max_tokens=512,
    )  # fmt: skip


def generation_args(max_tokens, temperature=0.0, top_k=0, logit_bias=None):
    """A request's ``GenerationArguments``, as the HTTP handler makes them."""
    from mlx_lm.server import (
        GenerationArguments,
        LogitsProcessorArguments,
        ModelDescription,
        SamplingArguments,
    )

    return GenerationArguments(
        model=ModelDescription("default_model", "default_model", None),
        sampling=SamplingArguments(temperature, 1.0, top_k, 0.0, 0.0, 0.1),
        logits=LogitsProcessorArguments(logit_bias, 0.0, 20, 0.0, 20, 0.0, 20),
        stop_words=[],
        max_tokens=max_tokens,
        num_draft_tokens=3,
        logprobs=False,
        top_logprobs=-1,
        seed=None,
        chat_template_kwargs=None,
    )
