"""Prompt cache entries: bytes stored and a fetch's peak, upstream vs patched.

A tiny gemma3_text (4 layers, every other one sliding, ``--window`` tokens)
prefills ``--prompts`` distinct prompts of ``--length`` tokens, each into a
fresh ``make_prompt_cache``, and inserts each into an ``LRUPromptCache``.
Reported per side (upstream: ``mlx_lm_patched.revert()``, patched, and
without_store: patched but ``prompt_cache_store`` reverted, the entries of
preallocated caches stored as they are):

  stored_bytes   the prompt cache's ``nbytes`` after the inserts
  held_bytes     active memory the entries hold once the working caches are gone
  live_bytes     the live tokens' bytes, counted from the model's geometry
  fetch_peak     MLX's peak over a fetch of the first prompt plus one decode
                 step, above the memory held before it (the entries)
  entry_bytes    that entry's bytes
  working_bytes  the fetched working cache's bytes after the step
  fetch_excess   fetch_peak - working_bytes: what the fetch and the step
                 hold beyond the working cache they leave: the step's
                 activations, and (patched) the 256-slot step a ``KVCache``
                 grown from an exactly sized entry concatenates, per layer
  tokens         greedy tokens after the fetch (the same on both sides)
"""

import argparse

import mlx.core as mx

import mlx_lm_patched

from . import emit, header, parse_args


def run_side(model, prompts, decode):
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache

    def step(cache, tokens):
        logits = model(mx.array(tokens)[None], cache=cache)
        mx.eval(logits, [c.state for c in cache])
        return logits

    mx.clear_cache()
    before = mx.get_active_memory()
    lru = LRUPromptCache(max_size=len(prompts))
    for p in prompts:
        cache = make_prompt_cache(model)
        step(cache, p)
        lru.insert_cache("model", p, cache)
        del cache
    mx.synchronize()  # the copies the inserts scheduled are made
    mx.clear_cache()
    held = mx.get_active_memory() - before

    entry = lru.fetch_nearest_cache("model", prompts[0])[0]
    entry_bytes = sum(c.nbytes for c in entry)
    del entry

    mx.clear_cache()
    start = mx.get_active_memory()
    mx.reset_peak_memory()
    cache, rest = lru.fetch_nearest_cache("model", prompts[0] + [0])
    logits = step(cache, rest)
    peak = mx.get_peak_memory() - start
    working = sum(c.nbytes for c in cache)
    tokens = []
    for _ in range(decode):
        tokens.append(mx.argmax(logits[0, -1]).item())
        logits = step(cache, [tokens[-1]])
    return {
        "entries": len(lru),
        "stored_bytes": lru.nbytes,
        "held_bytes": held,
        "fetch_peak": peak,
        "entry_bytes": entry_bytes,
        "working_bytes": working,
        "fetch_excess": peak - working,
        "tokens": tokens,
    }


def build_parser():
    p = argparse.ArgumentParser(prog="python -m mlx_lm_patched.bench prompt_cache")
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--length", type=int, default=60)
    p.add_argument("--window", type=int, default=1024)
    p.add_argument("--decode", type=int, default=8, help="greedy tokens after a fetch")
    p.add_argument("--device", choices=["cpu", "gpu"])
    p.add_argument("--out", help="also write the JSON to this file")
    return p


def main(argv=None):
    from mlx_lm_patched.demo import tiny

    args = parse_args(build_parser(), argv)
    mx.set_cache_limit(0)  # active memory counts what is held, not reused blocks
    model, _ = tiny.tiny_model("gemma3_text", sliding_window=args.window)
    config = tiny.model_config("gemma3_text")
    heads, dim = config["num_key_value_heads"], config["head_dim"]
    # Live tokens per layer: the prompt, or a sliding layer's window.
    slots = [min(args.length, args.window) for _ in range(config["num_hidden_layers"])]
    sliding = config["sliding_window_pattern"]
    slots = [args.length if (i + 1) % sliding == 0 else n for i, n in enumerate(slots)]
    prompts = [
        [(7 * i + 13 * j) % tiny.VOCAB_SIZE for j in range(args.length)]
        for i in range(args.prompts)
    ]
    dtype = model.model.embed_tokens.weight.dtype
    result = {
        **header("prompt_cache", [p.name for p in mlx_lm_patched.PATCHES]),
        "prompts": args.prompts,
        "length": args.length,
        "window": args.window,
        "live_bytes": 2 * heads * dim * dtype.size * sum(slots) * args.prompts,
    }
    for name, switch in (
        ("upstream", mlx_lm_patched.revert),
        ("patched", mlx_lm_patched.apply),
        (
            "without_store",
            lambda: mlx_lm_patched.revert("prompt_cache_store", "server_prompt_cache"),
        ),
    ):
        switch()
        result[name] = run_side(model, prompts, args.decode)
    mlx_lm_patched.apply()
    p, u = result["patched"], result["upstream"]
    result["targets"] = {
        "stored_is_live": p["stored_bytes"] == result["live_bytes"],
        "held_is_stored": p["held_bytes"] == p["stored_bytes"],
        "same_tokens": p["tokens"] == u["tokens"],
    }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
