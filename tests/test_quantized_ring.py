"""QuantizedRotatingKVCache: the patched ring, quantized; generate --kv-bits on rings.

Run as a script to print the quality figures (JSON): logit error and greedy
agreement of kv_bits 8 and 4 against the unquantized run, 500 decode steps.
"""

import gc
import itertools
import json
import random
import subprocess
import sys

import mlx.core as mx
import pytest
import ringref
from fuzzing import H, fuzz, layouts, ring_sessions, snapshot
from hypothesis import given
from hypothesis import strategies as st
from mlx_lm.generate import generate_step, maybe_quantize_kv_cache
from mlx_lm.models import cache as cache_module
from mlx_lm.models.cache import (
    RotatingKVCache,
    can_trim_prompt_cache,
    load_prompt_cache,
    save_prompt_cache,
)
from ringref import data_pointer, random_kv, reference_mask, same, same_mask, save_load

import mlx_lm_patched  # noqa: F401,E402  (applies the patches when run as a script)
from mlx_lm_patched.demo import tiny  # noqa: E402

QuantizedRotatingKVCache = cache_module.QuantizedRotatingKVCache


def make_prompt_cache(model, max_kv_size=None):
    """mlx-lm's, patched when the test is."""
    return cache_module.make_prompt_cache(model, max_kv_size)


def roundtrip(x, group_size=64, bits=8):
    """``x`` quantized and dequantized, token by token as the caches do."""
    return mx.dequantize(*mx.quantize(x, group_size, bits), group_size, bits)


def dequantized(parts, group_size=64, bits=8):
    return mx.dequantize(*parts, group_size, bits)


def sizes(rng, max_size):
    choices = [1, 1, 1, 2, 3, 5, max_size - 1, max_size, 2 * max_size + 1]
    return [rng.choice(choices) for _ in range(rng.randint(1, 12))]


@pytest.mark.parametrize("bits", [8, 4])
def test_attention_sees_the_fp_ring_quantized_token_by_token(patched, bits):
    rng = random.Random(bits)
    for _ in range(40):
        max_size, keep = rng.choice([8, 16]), rng.choice([0, 4])
        window = rng.choice([None, max_size - 2])
        fp = RotatingKVCache(max_size, keep)
        q = fp.to_quantized(group_size=64, bits=bits)
        assert type(q) is QuantizedRotatingKVCache
        for S in sizes(rng, max_size):
            k, v = random_kv(1, 2, S, 64)
            masks = [c.make_mask(S, window_size=window) for c in (fp, q)]
            assert same_mask(*masks)
            fk, fv = [mx.array(x) for x in fp.update_and_fetch(k, v)]
            qk, qv = [dequantized(p, bits=bits) for p in q.update_and_fetch(k, v)]
            assert same(qk, roundtrip(fk, bits=bits))
            assert same(qv, roundtrip(fv, bits=bits))
            assert (q.offset, q._idx, q.size()) == (fp.offset, fp._idx, fp.size())


def test_the_ring_is_allocated_once_and_written_in_place(patched):
    q = QuantizedRotatingKVCache(32, keep=4, bits=4)
    q.update_and_fetch(*random_kv(1, 2, 5, 64))
    shapes = [x.shape for x in q.keys + q.values]
    assert all(s[2] == 32 for s in shapes)
    for S in [1] * 40 + [7, 50, 1, 1]:
        q.update_and_fetch(*random_kv(1, 2, S, 64))
        assert [x.shape for x in q.keys + q.values] == shapes
    assert q.nbytes == sum(x.nbytes for x in q.keys + q.values)


def test_decode_writes_into_the_same_buffers_after_the_first_update(patched):
    q = QuantizedRotatingKVCache(32, keep=4, bits=8)
    pointers = set()
    for S in [5] + [1] * 60:
        mx.eval(q.update_and_fetch(*random_kv(1, 2, S, 64)))
        pointers.add(tuple(data_pointer(x) for x in q.keys + q.values))
    assert len(pointers) == 1


def test_converting_a_wrapped_fp_ring_keeps_its_layout(patched):
    fp = RotatingKVCache(16, keep=4)
    for S in [5, 9, 1, 1, 1, 20, 1]:
        fp.update_and_fetch(*random_kv(1, 2, S, 64))
    q = fp.to_quantized(bits=8)
    assert (q.offset, q._idx, q.keep, q.max_size) == (fp.offset, fp._idx, 4, 16)
    assert same(dequantized(q.keys), roundtrip(fp.keys))
    k, v = random_kv(1, 2, 1, 64)
    assert same_mask(fp.make_mask(1, window_size=12), q.make_mask(1, window_size=12))
    got = dequantized(q.update_and_fetch(k, v)[0])
    assert same(got, roundtrip(fp.update_and_fetch(k, v)[0]))


def test_trim_follows_the_fp_ring(patched):
    q = QuantizedRotatingKVCache(16, keep=4)
    q.update_and_fetch(*random_kv(1, 2, 10, 64))
    assert q.is_trimmable() and q.trim(3) == 3
    assert (q.offset, q._idx, q.size()) == (7, 7, 7)
    with pytest.raises(ValueError):
        q.trim(-1)
    q.update_and_fetch(*random_kv(1, 2, 20, 64))
    assert not q.is_trimmable()
    with pytest.raises(ValueError):
        q.trim(1)


@pytest.mark.parametrize("tokens", [10, 37])
def test_quantized_ring_survives_save_and_load_bit_exact(patched, tmp_path, tokens):
    q = QuantizedRotatingKVCache(16, keep=4, bits=4)
    q.update_and_fetch(*random_kv(1, 2, tokens, 64, dtype=mx.bfloat16))
    save_prompt_cache(str(tmp_path / "c.safetensors"), [q])
    (loaded,) = load_prompt_cache(str(tmp_path / "c.safetensors"))
    assert type(loaded) is QuantizedRotatingKVCache
    for a, b in zip(q.state, loaded.state):
        assert all(same(x, y) for x, y in zip(a, b)) if isinstance(a, tuple) else a == b
    k, v = random_kv(1, 2, 1, 64, dtype=mx.bfloat16)
    seen = [[mx.array(x) for x in c.update_and_fetch(k, v)[0]] for c in (q, loaded)]
    assert all(same(a, b) for a, b in zip(*seen))
    assert loaded.keys[0].shape[2] == 16


def test_dequantized_export_is_a_rotating_cache_of_the_original_dtype(patched):
    q = QuantizedRotatingKVCache(16, keep=4, bits=8)
    k, v = random_kv(1, 2, 25, 80, dtype=mx.bfloat16)  # 80: zero-padded to 96
    q.update_and_fetch(k, v)
    fp = q.to_kv_cache()
    assert type(fp) is RotatingKVCache and fp.keys.dtype == mx.bfloat16
    assert fp.keys.shape == (1, 2, 16, 80)
    assert (fp.offset, fp._idx, fp.keep, fp.max_size) == (25, q._idx, 4, 16)
    assert mx.allclose(fp.keys[..., 4:, :], k[..., -12:, :], atol=0.05).item()
    fp.update_and_fetch(*random_kv(1, 2, 3, 80, dtype=mx.bfloat16))
    assert fp.offset == 28


def test_a_quantized_ring_is_not_quantized_again(patched):
    cache = [RotatingKVCache(16, keep=4)]
    cache[0].update_and_fetch(*random_kv(1, 2, 4, 64))
    maybe_quantize_kv_cache(cache, 0, 64, 4)
    ring = cache[0]
    maybe_quantize_kv_cache(cache, 0, 64, 4)
    assert cache[0] is ring and type(ring) is QuantizedRotatingKVCache


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_ring_steps_back_within_its_slack_as_the_fp_ring(patched, bits):
    # The fp ring with slack is the reference: every trim it can do, the
    # quantized ring can, and both then hold the same tokens (quantized).
    rng = random.Random(bits)
    trims = 0
    for _ in range(12):
        slack = rng.choice([2, 4])
        fp = RotatingKVCache(16, keep=4, slack=slack)
        q = fp.to_quantized(bits=bits)
        assert q.slack == slack
        for S in sizes(rng, 16) + [1] * 20:
            k, v = random_kv(1, 2, S, 64)
            fk = fp.update_and_fetch(k, v)[0]
            qk = dequantized(q.update_and_fetch(k, v)[0], bits=bits)
            assert same(qk, roundtrip(mx.array(fk), bits=bits))
            assert q.trimmable_tokens() == fp.trimmable_tokens()
            n = rng.randint(0, fp.trimmable_tokens())
            if fp.offset > 16 and n and rng.random() < 0.4:
                assert can_trim_prompt_cache([q], n)
                assert q.trim(n) == fp.trim(n) == n
                trims += 1
            assert (q.offset, q._idx, q._lo, q._hi) == (
                fp.offset,
                fp._idx,
                fp._lo,
                fp._hi,
            )
            if rng.random() < 0.2:
                q = save_load(q)  # the undo ring survives save and load
    assert trims > 10
    beyond = q.trimmable_tokens() + 1
    if q.offset > 16:
        assert not can_trim_prompt_cache([q], beyond)
        with pytest.raises(ValueError):
            q.trim(beyond)


def test_trimmed_quantized_rings_give_the_logits_of_a_fresh_cache(patched, load_tiny):
    # gemma3_text: sliding layers of 64 (quantized rings) and full ones.
    # Cache A decodes 12 tokens past the wrap and trims 6 of them back
    # (within the slack of 8); cache B is built afresh the same way without
    # them. The next token's logits agree (float32 model: 1e-5).
    model, _ = load_tiny("gemma3_text")
    prompt, decoded, last = list(range(3, 103)), list(range(200, 212)), 7

    def cache_after(tokens):
        cache = cache_module.make_prompt_cache(model, slack=8)
        model(mx.array([prompt]), cache=cache)
        maybe_quantize_kv_cache(cache, 0, 64, 4)
        for t in tokens:
            model(mx.array([[t]]), cache=cache)
        return cache

    a, b = cache_after(decoded), cache_after(decoded[:6])
    assert type(a[0]) is QuantizedRotatingKVCache and a[0].offset > 64
    most = a[0].trimmable_tokens()  # the slack, and up to twice it held
    assert 8 <= most <= 16 and can_trim_prompt_cache(a, 6)
    assert not can_trim_prompt_cache(a, most + 1)
    assert cache_module.trim_prompt_cache(a, 6) == 6
    logits = [model(mx.array([[last]]), cache=c)[0, -1] for c in (a, b)]
    assert mx.abs(logits[0] - logits[1]).max().item() <= 1e-5


def test_upstream_cannot_quantize_a_rotating_cache(upstream):
    with pytest.raises(NotImplementedError):
        RotatingKVCache(16).to_quantized()


def active():
    gc.collect()
    return mx.get_active_memory()


def ring_memory(bits, max_size=2048, heads=8, head_dim=128):
    """Active memory a full ring of bf16 (``bits=None``) or quantized keys and
    values holds, cache only."""
    # The pipeline's marker of an earlier test (its dtype's size) goes first.
    sys.modules["mlx_lm.models.ring_buffer"]._previous_layer.clear()
    before = active()
    cache = RotatingKVCache(max_size, keep=4)
    if bits is not None:
        cache = cache.to_quantized(group_size=64, bits=bits)
    for _ in range(2):  # fill, then wrap
        k, v = random_kv(1, heads, max_size // 2, head_dim, dtype=mx.bfloat16)
        mx.eval(cache.update_and_fetch(k, v))
        del k, v
    mx.eval(cache.state)
    used = active() - before
    del cache
    return used


def test_quantized_ring_memory_against_the_bf16_ring(patched):
    limit = mx.set_cache_limit(0)
    try:
        fp, q8, q4 = ring_memory(None), ring_memory(8), ring_memory(4)
    finally:
        mx.set_cache_limit(limit)
    # Keys and values; a few bytes more where MLX's random key was replaced.
    assert 0 <= fp - 2 * 2048 * 8 * 128 * 2 < 1024
    assert q8 <= 0.55 * fp
    assert q4 <= 0.30 * fp


def run_greedy(model, prompt, steps, **kwargs):
    cache = make_prompt_cache(model, max_kv_size=kwargs.pop("max_kv_size", None))
    gen = generate_step(
        mx.array(prompt), model, max_tokens=steps, prompt_cache=cache, **kwargs
    )
    return [t for t, _ in gen], cache


@pytest.mark.parametrize("bits", [8, 4])
def test_generate_with_kv_bits_and_max_kv_size_runs_to_length(patched, load_tiny, bits):
    model, _ = load_tiny("llama")
    tokens, cache = run_greedy(
        model, list(range(1, 40)), 100, kv_bits=bits, max_kv_size=48,
        quantized_kv_start=0,
    )  # fmt: skip
    assert len(tokens) == 100
    assert {type(c) for c in cache} == {QuantizedRotatingKVCache}
    assert all(c.bits == bits and c.offset == 39 + 100 for c in cache)


def test_gemma3_sliding_layers_quantize(patched, load_tiny):
    model, _ = load_tiny("gemma3_text")
    tokens, cache = run_greedy(
        model, list(range(1, 100)), 100, kv_bits=4, quantized_kv_start=50
    )
    assert len(tokens) == 100
    assert [type(c).__name__ for c in cache] == [
        "QuantizedRotatingKVCache",
        "QuantizedKVCache",
    ] * 2
    assert [c.max_size for c in cache[::2]] == [64, 64]


def test_generate_command_runs_with_kv_bits_and_max_kv_size(make_tiny_dir):
    cmd = [
        sys.executable, "-m", "mlx_lm_patched.generate",
        "--model", str(make_tiny_dir("llama_sliding")),
        "--prompt", "The key and value cache", "--ignore-chat-template",
        "--max-tokens", "120", "--kv-bits", "4", "--max-kv-size", "48",
        "--quantized-kv-start", "0", "--verbose", "True",
    ]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "Generation: " in out.stdout


def teacher_forced_logits(model, prompt, tokens, kv_bits=None, max_kv_size=None):
    """Logits of each step feeding ``tokens``, quantizing as generate_step does
    with ``quantized_kv_start=0``."""
    cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    model(mx.array(prompt)[None], cache=cache)
    maybe_quantize_kv_cache(cache, 0, 64, kv_bits)
    out = []
    for t in tokens:
        out.append(model(mx.array([[t]]), cache=cache)[0, -1])
        maybe_quantize_kv_cache(cache, 0, 64, kv_bits)
        mx.eval(out[-1])
    return mx.stack(out)


def quality(model, steps=500, max_kv_size=None, prompt=tuple(range(1, 33))):
    """Per kv_bits: mean and max abs logit error and greedy agreement against
    the unquantized run, teacher-forced on its greedy tokens."""
    tokens, _ = run_greedy(model, list(prompt), steps, max_kv_size=max_kv_size)
    ref = teacher_forced_logits(
        model, prompt[:-1], [prompt[-1]] + tokens[:-1], None, max_kv_size
    )
    out = {}
    for bits in (8, 4):
        got = teacher_forced_logits(
            model, prompt[:-1], [prompt[-1]] + tokens[:-1], bits, max_kv_size
        )
        err = mx.abs(got - ref)
        agree = mx.mean(mx.argmax(got, -1) == mx.argmax(ref, -1)).item()
        out[bits] = {
            "mean_abs_logit_error": round(mx.mean(err).item(), 5),
            "max_abs_logit_error": round(mx.max(err).item(), 5),
            "greedy_agreement": round(agree, 4),
        }
    return out


def test_quantized_logits_stay_close_to_the_unquantized_run(patched, load_tiny):
    model, _ = load_tiny("llama")
    q = quality(model, steps=100, max_kv_size=48)
    assert q[8]["greedy_agreement"] >= 0.95 and q[4]["greedy_agreement"] >= 0.8
    assert q[8]["mean_abs_logit_error"] < q[4]["mean_abs_logit_error"]


if __name__ == "__main__":
    from mlx_lm_patched.demo import tiny

    report = {}
    runs = [("llama", 128), ("llama", None), ("gemma3_text", None)]
    for (family, max_kv_size), head_dim in itertools.product(runs, (16, 128)):
        model, _ = tiny.tiny_model(family, head_dim=head_dim)
        name = f"{family}, head_dim={head_dim}, max_kv_size={max_kv_size}"
        report[name] = quality(model, 500, max_kv_size)
    print(json.dumps(report, indent=2))


def check_ring_state(ours, fp, window):
    assert (ours.offset, ours._idx, ours.size()) == (fp.offset, fp._idx, fp.size())
    assert ours.is_trimmable() == fp.is_trimmable()
    for N in (1, 2, fp.max_size, fp.max_size + 1):
        got = ours.make_mask(N, window_size=window, return_array=True)
        assert same_mask(fp.make_mask(N, window_size=window, return_array=True), got)
    kv = ours.to_kv_cache()
    assert type(kv) is RotatingKVCache
    if fp.offset == 0:
        assert kv.offset == 0
    else:
        assert same(kv.state, fp.state)


@fuzz
@given(ring_sessions(), layouts, st.integers(0, 2**31 - 1))
def test_quantized_ring_equals_the_fp_ring_fed_the_quantized_tokens(
    session, layout, seed
):
    """Updates of 1 to ``2 * max_size`` tokens, trims and save/load: the
    quantized ring keeps the fp ring's offsets, slots and masks, hands
    attention exactly the fp ring's tokens, attends as plain attention over
    them (which sees the reference window) and exports the fp ring's state."""
    max_size, keep, window, ops = session
    mx.random.seed(seed)
    fp = RotatingKVCache(max_size, keep)
    ours = RotatingKVCache(max_size, keep).to_quantized(layout.group_size, layout.bits)
    hk, hv = (mx.zeros((1, H, 0, layout.dim), layout.dtype) for _ in range(2))
    for op, n in ops:
        if op == "trim":
            if not fp.is_trimmable():
                continue
            trimmed = fp.trim(n)
            assert ours.trim(n) == trimmed == min(n, hk.shape[2])
            hk, hv = hk[..., : fp.offset, :], hv[..., : fp.offset, :]
        elif op == "save_load":
            before = ours.state
            ours, fp = save_load(ours), save_load(fp)
            assert same(ours.state, before)
        else:
            (k, v), (rk, rv) = layout.kv(1, n)
            q = layout.queries(1, n)
            offset = fp.offset
            fmask = fp.make_mask(n, window_size=window)
            qmask = ours.make_mask(n, window_size=window)
            assert same_mask(fmask, qmask)
            fkv = snapshot(fp.update_and_fetch(rk, rv))
            qkv = snapshot(ours.update_and_fetch(k, v))
            assert same([layout.tokens(ours, p) for p in qkv], fkv)
            got, want = layout.attention(q, ours, qkv, qmask, fkv, fmask)
            assert layout.close(got, want)
            hk = mx.concatenate([hk, rk], axis=2)
            hv = mx.concatenate([hv, rv], axis=2)
            window_seen = min(window or max_size, max_size)
            ref_mask = reference_mask(offset, n, window_seen, keep)
            _, ref = layout.attention(q, ours, qkv, qmask, (hk, hv), ref_mask)
            assert mx.allclose(want, ref, atol=1e-5).item()
        assert fp.offset == hk.shape[2]
        check_ring_state(ours, fp, window)


@pytest.mark.parametrize("name", ["cpu", "cuda", "metal"])
def test_a_forward_pass_past_the_quantized_ring_syncs_only_on_cuda(monkeypatch, name):
    """Every ``mx.eval`` of whole model calls: chunks past the ring, decode.
    CUDA's road waits in each layer's attention for the previous layer's
    (its dequantized keys)."""
    ringref.fake_backend(monkeypatch, name)
    config = tiny.model_config("llama", head_dim=64, hidden_size=128)
    model = tiny.build_model(config, dtype="bfloat16")
    cache = [QuantizedRotatingKVCache(64, keep=4, bits=8) for _ in model.layers]
    evals = ringref.eval_calls(monkeypatch)
    for n in (48, 48, 100, 1, 1):
        mx.eval(model(mx.arange(n)[None] % 512, cache=cache))
    chained = 5 * len(model.layers) - 1 if name == "cuda" else 0
    assert len(evals) == 5 + chained
