"""make_prompt_cache(model, max_kv_size) bounds models that build their own cache."""

import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.models import cache as cache_module
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from mlx_lm_patched.caches import max_kv_size
from mlx_lm_patched.demo import tiny

PROMPT = " ".join(tiny.TEXT.split()[:60])


def make_prompt_cache(model, max_kv_size=None):
    """mlx-lm's, patched or not as the test has it."""
    return cache_module.make_prompt_cache(model, max_kv_size)


def kinds(cache):
    return [
        (type(c).__name__, getattr(c, "max_size", None), getattr(c, "keep", None))
        for c in cache
    ]


def test_full_attention_layers_become_rings_of_max_kv_size(patched, load_tiny):
    model, _ = load_tiny("llama")
    assert (
        kinds(make_prompt_cache(model, max_kv_size=512))
        == [("RotatingKVCache", 512, 4)] * 4
    )
    assert kinds(make_prompt_cache(model)) == [("KVCache", None, None)] * 4


def test_sliding_layers_keep_their_window_unless_max_kv_size_is_smaller(
    patched, load_tiny
):
    model, _ = load_tiny("gemma3_text")
    # Layers 0 and 2 slide (window 64), 1 and 3 are full attention.
    assert (
        kinds(make_prompt_cache(model, max_kv_size=512))
        == [
            ("RotatingKVCache", 64, 0),
            ("RotatingKVCache", 512, 4),
        ]
        * 2
    )
    assert (
        kinds(make_prompt_cache(model, max_kv_size=32))
        == [
            ("RotatingKVCache", 32, 0),
            ("RotatingKVCache", 32, 4),
        ]
        * 2
    )


def test_other_caches_are_left_alone(patched):
    class Model:
        def make_cache(self):
            return [ArraysCache(2), CacheList(KVCache()), KVCache()]

    cache = make_prompt_cache(Model(), max_kv_size=16)
    assert [type(c) for c in cache] == [ArraysCache, CacheList, RotatingKVCache]
    assert type(cache[1][0]) is KVCache


def test_upstream_ignores_max_kv_size_for_models_with_make_cache(upstream, load_tiny):
    model, _ = load_tiny("llama")
    assert (
        kinds(make_prompt_cache(model, max_kv_size=512))
        == [("KVCache", None, None)] * 4
    )


def test_changed_layers_are_warned_once(patched, load_tiny):
    model, _ = load_tiny("llama_sliding")
    max_kv_size._bounded_logged.clear()
    with pytest.warns(UserWarning) as record:
        for _ in range(3):
            make_prompt_cache(model, max_kv_size=48)
        make_prompt_cache(model, max_kv_size=40)
    assert [str(w.message) for w in record] == [
        "mlx_lm_patched: max_kv_size=48 bounds 4 of 4 cache layers of llama: "
        "layers 0, 2: RotatingKVCache(64) -> RotatingKVCache(48, keep=0); "
        "layers 1, 3: KVCache -> RotatingKVCache(48, keep=4)",
        "mlx_lm_patched: max_kv_size=40 bounds 4 of 4 cache layers of llama: "
        "layers 0, 2: RotatingKVCache(64) -> RotatingKVCache(40, keep=0); "
        "layers 1, 3: KVCache -> RotatingKVCache(40, keep=4)",
    ]


def test_max_kv_size_below_1_raises_before_the_model_builds_a_cache(patched, load_tiny):
    class Model:
        layers = [None] * 2

        def make_cache(self):
            raise AssertionError("make_cache called")

    for model in (Model(), load_tiny("qwen3")[0]):
        for value in (0, -1):
            with pytest.raises(ValueError, match=f"max_kv_size must be >= 1.*{value}"):
                make_prompt_cache(model, max_kv_size=value)


def kv_bytes_per_step(model, steps, max_kv_size=None):
    """Sum of the cache's ``nbytes`` after each decode step of a greedy run."""
    cache = make_prompt_cache(model, max_kv_size=max_kv_size)
    prompt = mx.array([1, 2, 3, 4, 5, 6, 7, 8])
    out = []
    for _ in generate_step(prompt, model, max_tokens=steps, prompt_cache=cache):
        out.append(sum(c.nbytes for c in cache))
    return out


def ring_bytes(model, max_kv_size):
    """What ``max_kv_size`` tokens of every layer's keys and values take."""
    args = model.args
    per_token = 2 * args.num_key_value_heads * args.head_dim * 4  # float32
    return len(model.layers) * max_kv_size * per_token


def test_kv_bytes_are_flat_at_the_ring_size_from_the_first_decode_step(
    patched, load_tiny
):
    model, _ = load_tiny("llama")
    seen = kv_bytes_per_step(model, 2000, max_kv_size=512)
    assert len(seen) == 2000
    assert set(seen) == {ring_bytes(model, 512)}


def test_upstream_kv_bytes_grow_past_max_kv_size(upstream, load_tiny):
    model, _ = load_tiny("llama")
    seen = kv_bytes_per_step(model, 600, max_kv_size=512)
    assert seen[-1] > ring_bytes(model, 512)


def generate_front(model_dir, *args, prompt="The key and value cache"):
    """``python -m mlx_lm_patched.generate`` on ``model_dir``, finished."""
    cmd = [sys.executable, "-m", "mlx_lm_patched.generate"]
    cmd += ["--model", str(model_dir), "--prompt", prompt, "--ignore-chat-template"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=120)


def test_generate_command_runs_with_max_kv_size(make_tiny_dir):
    args = ["--max-tokens", "300", "--max-kv-size", "64", "--verbose", "True"]
    out = generate_front(make_tiny_dir("llama"), *args)
    assert out.returncode == 0, out.stderr
    assert "Generation: " in out.stdout


@pytest.mark.parametrize("value", ["0", "-1"])
def test_generate_command_rejects_max_kv_size_below_1_in_one_line(make_tiny_dir, value):
    out = generate_front(make_tiny_dir("llama"), "--max-kv-size", value)
    assert out.returncode != 0
    message = (
        "mlx_lm_patched.generate: error: "
        f"max_kv_size must be >= 1 (tokens a layer), got {value}"
    )
    assert out.stderr.strip().splitlines() == [message]


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3_text"])
@pytest.mark.parametrize("value", ["1", "3"])
def test_generate_command_runs_with_a_max_kv_size_no_larger_than_keep(
    make_tiny_dir, family, value
):
    args = ["--max-kv-size", value, "--max-tokens", "20", "--verbose", "True"]
    out = generate_front(make_tiny_dir(family), *args, prompt=PROMPT)
    assert out.returncode == 0, out.stderr
    assert "Generation: 20 tokens" in out.stdout


def test_generate_command_matches_upstream_on_the_smallest_ring_keeping_4(
    make_tiny_dir,
):
    """qwen3 builds no cache itself: upstream gives it RotatingKVCache(5,
    keep=4) too, and fed token by token its ring is right."""
    args = ["--max-kv-size", "5", "--prefill-step-size", "1", "--max-tokens", "30"]
    ours = generate_front(make_tiny_dir("qwen3"), *args, prompt=PROMPT)
    cmd = [sys.executable, "-m", "mlx_lm.generate", "--model"]
    cmd += [str(make_tiny_dir("qwen3")), "--prompt", PROMPT, "--ignore-chat-template"]
    theirs = subprocess.run(cmd + args, capture_output=True, text=True, timeout=120)
    assert ours.returncode == theirs.returncode == 0, ours.stderr + theirs.stderr
    assert (
        ours.stdout.split("==========\n")[1] == theirs.stdout.split("==========\n")[1]
    )


def test_generate_command_shows_which_layers_max_kv_size_bounds_once_on_stderr(
    make_tiny_dir,
):
    args = ["--max-kv-size", "48", "--max-tokens", "100", "--prefill-step-size", "16"]
    out = generate_front(make_tiny_dir("gemma3_text"), *args, prompt=PROMPT)
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("max_kv_size=48 bounds 4 of 4 cache layers") == 1
    assert "UserWarning" in out.stderr


@pytest.mark.parametrize("family", ["gemma3_text", "llama_sliding"])
def test_generate_output_does_not_depend_on_prefill_step_size_below_the_window(
    make_tiny_dir, family
):
    """``--max-kv-size 48`` shrinks the sliding layers (window 64) to 48-slot
    rings: chunked prefill must see the same 48 tokens as decode does."""
    texts = set()
    for step in ("1", "16", "2048"):
        args = ["--max-kv-size", "48", "--prefill-step-size", step]
        out = generate_front(
            make_tiny_dir(family), *args, "--max-tokens", "20", prompt=PROMPT
        )
        assert out.returncode == 0, out.stderr
        texts.add(out.stdout.split("==========\n")[1])
    assert len(texts) == 1, texts


@pytest.mark.parametrize("family", ["gemma3_text", "llama_sliding"])
def test_greedy_tokens_do_not_depend_on_prefill_step_size_below_the_window(
    patched, load_tiny, family
):
    model, _ = load_tiny(family)
    prompt = mx.random.randint(0, 512, (150,), key=mx.random.key(0))

    def run(step):
        cache = make_prompt_cache(model, max_kv_size=48)
        steps = generate_step(
            prompt, model, max_tokens=40, prompt_cache=cache, prefill_step_size=step
        )
        return [int(t) for t, _ in steps]

    one_by_one = run(1)
    assert run(16) == run(100) == run(2048) == one_by_one


def test_batch_generate_does_not_depend_on_prefill_step_size_below_the_window(
    patched, load_tiny
):
    """gemma3_text's sliding layers (window 64) shrunk to 48-slot batch rings:
    batched rows equal their single streams, whatever the prefill step."""
    model, tokenizer = load_tiny("gemma3_text")
    prompts = [
        mx.random.randint(0, 512, (n,), key=mx.random.key(n)).tolist()
        for n in (40, 150, 90)
    ]
    batched = [
        batch_generate(
            model,
            tokenizer,
            prompts,
            max_tokens=30,
            max_kv_size=48,
            prefill_step_size=step,
            return_token_ids=True,
        ).token_ids
        for step in (16, 2048)
    ]
    singles = []
    for p in prompts:
        cache = make_prompt_cache(model, max_kv_size=48)
        steps = generate_step(mx.array(p), model, max_tokens=30, prompt_cache=cache)
        singles.append([int(t) for t, _ in steps])
    assert batched[0] == batched[1] == singles
