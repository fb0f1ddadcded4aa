"""``make demo``: the drop-in front end to end, then patched next to upstream.

Runs ``python -m mlx_lm_patched.generate`` on a tiny local model (llama with
sliding layers, so its cache mixes ``RotatingKVCache`` and ``KVCache``), then
the same greedy generation in-process with the patches reverted and applied,
and prints peak memory, cache bytes, cache buffer reallocations and whether
the tokens match. Works with whatever is in ``mlx_lm_patched.PATCHES``.
"""

import argparse
import re
import subprocess
import sys
from collections import Counter

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as cache_module
from mlx_lm.utils import load

import mlx_lm_patched
from mlx_lm_patched import tiny


def printable(text: str) -> str:
    """Random weights emit random bytes; keep control characters off the terminal."""
    return re.sub(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", " ", text)


def measure(model, prompt, args, max_kv_size):
    """Tokens, peak memory of prefill and of decode, final cache bytes."""
    cache = cache_module.make_prompt_cache(model, max_kv_size)
    mx.clear_cache()
    mx.reset_peak_memory()
    tokens, peaks = [], []
    for token, _ in generate_step(
        prompt,
        model,
        max_tokens=args.max_tokens,
        prompt_cache=cache,
        prefill_step_size=args.prefill_step_size,
    ):
        if not tokens:
            peaks.append(mx.get_peak_memory())
            mx.reset_peak_memory()
        tokens.append(token)
    peaks.append(mx.get_peak_memory())
    return tokens, peaks, sum(c.nbytes for c in cache)


def buffers(keys):
    """Address and shape of each array behind a cache's ``keys``."""
    arrays = keys if isinstance(keys, (tuple, list)) else [keys]
    return [
        (np.frombuffer(memoryview(a), np.uint8).ctypes.data, a.shape) for a in arrays
    ]


def count_reallocations(model, prompt, args, max_kv_size):
    """Per phase and cache type: how often a layer's ``keys`` moved to another
    buffer or changed shape between two prompt chunks or two decode steps
    (its first allocation not counted). Prefills the way ``generate_step``
    does. Only addresses are kept, so no buffer outlives its cache's use."""
    cache = cache_module.make_prompt_cache(model, max_kv_size)
    last = [None] * len(cache)
    counts = Counter()

    def observe(phase):
        for i, c in enumerate(cache):
            keys = getattr(c, "keys", None)
            now = None if keys is None else buffers(keys)
            counts[phase, type(c).__name__] += last[i] is not None and now != last[i]
            last[i] = now

    step = args.prefill_step_size
    for start in range(0, prompt.size - 1, step):
        model(prompt[None, start : min(start + step, prompt.size - 1)], cache=cache)
        mx.eval([c.keys for c in cache if getattr(c, "keys", None) is not None])
        observe("prompt")
    for _ in generate_step(
        prompt[-1:], model, max_tokens=args.max_tokens, prompt_cache=cache
    ):
        observe("decode")
    return counts


def run(model, prompt, args, max_kv_size):
    tokens, peaks, nbytes = measure(model, prompt, args, max_kv_size)
    reallocs = count_reallocations(model, prompt, args, max_kv_size)
    kinds = Counter(
        type(c).__name__ for c in cache_module.make_prompt_cache(model, max_kv_size)
    )
    return {
        "tokens": tokens,
        "peaks": peaks,
        "nbytes": nbytes,
        "reallocs": reallocs,
        "kinds": kinds,
    }


def mb(n):
    return f"{n / 1e6:.2f} MB"


def compare(model, prompt, args, max_kv_size):
    """Print upstream next to patched; return whether the tokens match."""
    before = [n for n, s in mlx_lm_patched.status().items() if s["applied"]]
    try:
        mlx_lm_patched.revert()
        upstream = run(model, prompt, args, max_kv_size)
        mlx_lm_patched.apply()
        patched = run(model, prompt, args, max_kv_size)
    finally:
        mlx_lm_patched.revert()
        if before:
            mlx_lm_patched.apply(*before)

    def caches(r):
        return ", ".join(f"{n} {k}" for k, n in sorted(r["kinds"].items()))

    print(f"  {'':<42}{'upstream':>16}{'patched':>16}")
    rows = [
        ("peak memory, prompt", mb(upstream["peaks"][0]), mb(patched["peaks"][0])),
        ("peak memory, decode", mb(upstream["peaks"][1]), mb(patched["peaks"][1])),
        ("cache bytes at the end", mb(upstream["nbytes"]), mb(patched["nbytes"])),
    ]
    keys = set(upstream["reallocs"]) | set(patched["reallocs"])
    for phase, kind in sorted(keys, key=lambda k: (k[0] == "decode", k[1])):
        key = (phase, kind)
        label = f"reallocations, {phase}, {kind}"
        rows.append((label, upstream["reallocs"][key], patched["reallocs"][key]))
    for label, a, b in rows:
        print(f"  {label:<42}{a:>16}{b:>16}")
    print(f"  caches: upstream {caches(upstream)}; patched {caches(patched)}")
    same = upstream["tokens"] == patched["tokens"]
    agree = sum(a == b for a, b in zip(upstream["tokens"], patched["tokens"]))
    print(f"  tokens identical: {'yes' if same else 'NO'}", end="")
    print(f" ({agree} of {len(upstream['tokens'])} agree)")
    return same


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="model directory (default: the demo model)")
    parser.add_argument("--prompt-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=300)
    parser.add_argument("--max-kv-size", type=int, default=512)
    parser.add_argument("--prefill-step-size", type=int, default=256)
    args = parser.parse_args()

    path = str(args.model or tiny.demo_model_dir())
    model, tokenizer = load(path)
    words = tiny.TEXT.split()
    text, n = "", 0
    while len(tokenizer.encode(text)) < args.prompt_tokens:
        text += " " + words[n % len(words)]
        n += 1
    messages = [{"role": "user", "content": text.strip()}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    print(f"Model: {path}; prompt {len(prompt)} tokens")

    print("\n$ python -m mlx_lm_patched.generate --model ... --prompt <text>", end="")
    flags = ["--max-tokens", args.max_tokens, "--max-kv-size", args.max_kv_size]
    flags += ["--prefill-step-size", args.prefill_step_size]
    flags = [str(f) for f in flags]
    print(" " + " ".join(flags))
    cmd = [sys.executable, "-m", "mlx_lm_patched.generate", "--model", path]
    cmd += ["--prompt", text.strip()] + flags
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    print(printable(done.stdout))
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        sys.exit(f"mlx_lm_patched.generate failed with exit status {done.returncode}")

    print("Patches:")
    for name, s in mlx_lm_patched.status().items():
        state = "drift: " + "; ".join(s["drift"]) if s["drift"] else "ok"
        print(f"  {name:<26} {state}")
    if not mlx_lm_patched.PATCHES:
        print("  (none in mlx_lm_patched.PATCHES yet: both columns run upstream)")

    prompt = mx.array(prompt)
    print(f"\nThe same generation in-process ({args.max_tokens} tokens, greedy),")
    print("with the model's own caches:")
    same = compare(model, prompt, args, None)
    print(
        f"\nand with max_kv_size={args.max_kv_size}, which upstream ignores for models with"
    )
    print("make_cache (bounded caches forget, so here the tokens may differ):")
    compare(model, prompt, args, args.max_kv_size)
    if not same:
        sys.exit("the patches changed the tokens of the model's own caches")


if __name__ == "__main__":
    main()
