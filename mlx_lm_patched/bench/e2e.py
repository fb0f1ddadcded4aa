"""End-to-end: a Llama-8B-shaped model with random bf16 weights, generating.

A ``--prompt``-token prompt is prefilled in ``--chunk``-token chunks as
``mlx_lm.generate.generate_step`` does (each chunk's peak recorded), then
``generate_step`` decodes ``--decode`` tokens, once per cache:
``RotatingKVCache(--max-size, keep)`` per layer upstream (reverted) and
patched (applied), and an unbounded ``KVCache`` (and with ``--only PATCH``,
rings with just that patch applied). Reports peak memory above
the weights during prefill and during decode, and decode tokens per second:
each cache is warmed up once, then measured ``--rounds`` times in alternating
order; peaks are the worst round's, speeds the mean.
No files: the weights are made on the device.

    python -m mlx_lm_patched.bench.e2e [--out e2e.json]
"""

import argparse
import functools
import gc
import sys
import time

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, RotatingKVCache

import mlx_lm_patched

from . import emit, header, parse_args


def build_model(args):
    model = llama.Model(
        llama.ModelArgs(
            model_type="llama",
            hidden_size=args.hidden,
            num_hidden_layers=args.layers,
            intermediate_size=args.intermediate,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            rms_norm_eps=1e-5,
            vocab_size=args.vocab,
            rope_theta=500000.0,
            tie_word_embeddings=False,
        )
    )
    model.set_dtype(getattr(mx, args.dtype))
    for layer in model.layers:  # one layer's float32 init alive at a time
        mx.eval(layer.parameters())
    mx.eval(model.parameters())
    return model


def _caches(args, kind):
    if kind == "kvcache":
        return [KVCache() for _ in range(args.layers)]
    return [RotatingKVCache(args.max_size, keep=args.keep) for _ in range(args.layers)]


def _only(patch):
    mlx_lm_patched.revert()
    mlx_lm_patched.apply(patch, strict=True)


def _peak(weights):
    return max(mx.get_peak_memory(), mx.get_active_memory()) - weights


def run(model, args, kind, prompt, weights):
    gc.collect()
    mx.clear_cache()
    cache = _caches(args, kind)
    # generate_step's prefill, one chunk at a time to see each chunk's peak:
    # all but the last token in chunks, evaluating the caches' state.
    chunk_peaks = []
    tic = time.perf_counter()
    for i in range(0, len(prompt) - 1, args.chunk):
        mx.reset_peak_memory()
        model(prompt[i : min(i + args.chunk, len(prompt) - 1)][None], cache=cache)
        mx.eval([c.state for c in cache])
        chunk_peaks.append(_peak(weights))
    mx.reset_peak_memory()
    gen = generate_step(
        prompt[-1:],
        model,
        max_tokens=args.decode + 1,
        prompt_cache=cache,
        sampler=lambda x: mx.argmax(x, axis=-1),
    )
    next(gen)
    prefill_s = time.perf_counter() - tic
    first_token_peak = _peak(weights)
    mx.reset_peak_memory()
    tic = time.perf_counter()
    n = sum(1 for _ in gen)
    decode_s = time.perf_counter() - tic
    out = {
        "prefill_s": prefill_s,
        "prefill_tok_s": len(prompt) / prefill_s,
        "prefill_peak_above_weights": max(chunk_peaks + [first_token_peak]),
        "chunk_peaks_above_weights": chunk_peaks,
        "decode_tokens": n,
        "decode_tok_s": n / decode_s,
        "decode_peak_above_weights": _peak(weights),
        "cache_nbytes_end": sum(c.nbytes for c in cache),
    }
    del cache, gen
    gc.collect()
    mx.clear_cache()
    return out


def _merge(values, key):
    """Peaks: the worst round's; the rest: the mean."""
    if isinstance(values[0], list):
        return [_merge(list(x), key) for x in zip(*values)]
    return max(values) if "peak" in key else np.mean(values)


def _plain(v):
    if isinstance(v, list):
        return [_plain(x) for x in v]
    return int(v) if float(v).is_integer() else float(v)


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_lm_patched.bench.e2e",
        description="Random-weight Llama-8B shape: rotating caches end to end.",
    )
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--prompt", type=int, default=6000)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--max-size", type=int, default=4096)
    p.add_argument("--keep", type=int, default=4)
    p.add_argument("--decode", type=int, default=300)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="measured runs per cache, in alternating order, after a warm-up",
    )
    p.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PATCH",
        help="also measure rings with only this patch applied (repeatable)",
    )
    p.add_argument("--device", choices=["cpu", "gpu"], help="default: MLX's")
    p.add_argument("--out", help="also write the JSON to this file")
    return p


def main(argv=None):
    args = parse_args(build_parser(), argv)
    model = build_model(args)
    gc.collect()
    mx.clear_cache()
    weights = mx.get_active_memory()
    prompt = mx.random.randint(0, args.vocab, (args.prompt,))
    mx.eval(prompt)
    result = {
        **header("e2e", [p.name for p in mlx_lm_patched.PATCHES]),
        "config": vars(args),
        "weights_bytes": weights,
    }
    sides = {
        "upstream": (mlx_lm_patched.revert, "rotating"),
        "patched": (mlx_lm_patched.apply, "rotating"),
        "kvcache": (mlx_lm_patched.apply, "kvcache"),
    }
    for patch in args.only:
        sides[f"only_{patch}"] = (functools.partial(_only, patch), "rotating")
    runs = {name: [] for name in sides}
    for r in range(-1, args.rounds):  # round -1 warms up: kernels, pools
        for name in list(sides)[:: 1 if r % 2 else -1]:
            switch, kind = sides[name]
            switch()
            print(f"[e2e] {name} round {r}", file=sys.stderr, flush=True)
            out = run(model, args, kind, prompt, weights)
            if r >= 0:
                runs[name].append(out)
    for name, outs in runs.items():
        # Peaks: the worst round; speeds: the mean.
        result[name] = {k: _merge([o[k] for o in outs], k) for k in outs[0]}
        result[name]["decode_tok_s_by_round"] = [o["decode_tok_s"] for o in outs]
        result[name] = {k: _plain(v) for k, v in result[name].items()}
    mlx_lm_patched.apply()
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
