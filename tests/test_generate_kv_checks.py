"""generate checks --kv-bits and --kv-group-size before the first token, and
accepts a prompt cache file whose group size was lowered to fit its head dims."""

import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.generate import batch_generate, generate_step
from ringref import python

from mlx_lm_patched.demo import tiny

PROMPT = " ".join(tiny.TEXT.split()[:60])


KV_ARGS = {
    "bits 16": (
        {"kv_bits": 16},
        r"kv_bits \(--kv-bits\) must be 2, 3, 4, 5, 6 or 8, got 16",
    ),
    "group size 48": (
        {"kv_bits": 8, "kv_group_size": 48},
        r"kv_group_size \(--kv-group-size\) must be 32, 64 or 128, got 48",
    ),
}


@pytest.mark.parametrize("case", KV_ARGS)
def test_generate_step_refuses_unsupported_kv_quantization_before_any_token(
    case, load_tiny
):
    model, tokenizer = load_tiny("llama")
    kwargs, message = KV_ARGS[case]
    prompt = mx.array(tokenizer.encode("the cache forgets nothing"))
    steps = generate_step(prompt, model, max_tokens=20, **kwargs)  # start: 5000
    with pytest.raises(ValueError, match=message):
        next(steps)


@pytest.mark.parametrize("case", KV_ARGS)
def test_batch_generate_refuses_unsupported_kv_quantization(case, load_tiny):
    model, tokenizer = load_tiny("llama")
    kwargs, message = KV_ARGS[case]
    prompts = [tokenizer.encode("the cache"), tokenizer.encode("forgets nothing")]
    with pytest.raises(ValueError, match=message):
        batch_generate(model, tokenizer, prompts, max_tokens=20, **kwargs)


@pytest.mark.parametrize("front", ["generate", "server"])
def test_fronts_refuse_kv_bits_16_before_generating_or_serving(front, tiny_model_dir):
    args = ["--model", str(tiny_model_dir), "--kv-bits", "16"]
    args += ["--prompt", "hello"] if front == "generate" else ["--port", "0"]
    done = subprocess.run(
        [sys.executable, "-m", f"mlx_lm_patched.{front}", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    assert "kv_bits (--kv-bits) must be 2, 3, 4, 5, 6 or 8, got 16" in done.stderr
    assert done.stdout.strip() in ("", "==========")


@pytest.mark.parametrize("head_dim", [96, 16])
def test_generate_continues_a_quantized_file_cache_prompt_wrote_with_the_same_flags(
    head_dim, make_tiny_dir, tmp_path
):
    """64 divides neither head dim: the cache quantizes with group size 32
    (96) or zero-pads to 32 (16), and saves the group size it uses. The
    default --kv-group-size 64 still asks for that group size."""
    from mlx_lm.models.cache import load_prompt_cache

    model, path = str(make_tiny_dir("llama", head_dim=head_dim)), str(
        tmp_path / "f.safetensors"
    )
    args = ["--prompt-cache-file", path, "--kv-bits", "8"]
    python("-m", "mlx_lm_patched.cache_prompt", "--model", model, "--prompt", PROMPT,
           "--quantized-kv-start", "0", *args)  # fmt: skip
    assert load_prompt_cache(path)[0].group_size == 32
    more = ["--prompt", " more", "--max-tokens", "5"]
    out = python("-m", "mlx_lm_patched.generate", *args, *more).stdout
    assert "Generation: 5 tokens" in out


def test_generate_still_refuses_a_group_size_the_file_was_not_quantized_with(
    make_tiny_dir, tmp_path
):
    model, path = str(make_tiny_dir("llama", head_dim=64)), str(
        tmp_path / "f.safetensors"
    )
    args = ["--prompt-cache-file", path, "--kv-bits", "8"]
    python("-m", "mlx_lm_patched.cache_prompt", "--model", model, "--prompt", PROMPT,
           "--quantized-kv-start", "0", *args)  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "mlx_lm_patched.generate", *args, "--prompt", " more"]
        + ["--kv-group-size", "32"],
        capture_output=True,
        text=True,
    )
    assert done.returncode != 0
    assert "--kv-group-size does not match" in done.stderr
