"""End-to-end: a Llama-8B-shaped model with random bf16 weights, generating.

Three scenarios, each upstream (``revert()``) against patched (``apply()``)
against an unbounded ``KVCache``, in one run, one JSON:

- ``single``: for each ``--prompts`` length, the prompt is prefilled in
  ``--chunk``-token chunks as ``generate_step`` does (each chunk's peak
  recorded), then ``generate_step`` decodes ``--decode`` tokens. Caches:
  ``RotatingKVCache(--max-size, keep)`` per layer upstream and patched, and
  an unbounded ``KVCache``. Then upstream's and the patched ring decode side
  by side, in alternating blocks of 16 steps (``decode_interleaved_ms``):
  the decode target is read there, where both see the same clocks.
- ``quantized``: the ``--kv-prompt`` prompt with ``kv_bits`` 4 and 8
  (quantized from the first token), ring and ``KVCache``, next to their
  bfloat16 runs; upstream's errors are recorded (on MLX CUDA its quantized
  attention has no kernel, and its ring cannot be quantized). Then the
  ``batch`` workload below with ``kv_bits``, with ``max_kv_size`` and
  without, next to its bfloat16 runs (patched only: upstream's
  ``BatchGenerator`` takes no ``kv_bits``).
- ``batch``: ``BatchGenerator`` with ``--batch-prompts`` (4 prompts), greedy,
  ``--batch-new`` tokens each, with ``max_kv_size`` ``--batch-max-kv`` and
  without (``BatchKVCache``, left-padded), upstream and patched, all four in
  one alternating series of ``--batch-rounds`` rounds; ``ratios`` of the
  bounded batch over the unbounded one, patched.

Each case is warmed up once, then measured ``--rounds`` times in alternating
order: peaks are the worst round's, times the median round's (decode:
the median step). Peaks are bytes above the weights. ``ratios`` and
``targets`` compare patched to the unbounded cache and to upstream. The JSON
is also written (``--out``) after every case, so a run cut short keeps what
it measured. ``--small`` is a CPU-sized model and workload.

    python -m mlx_lm_patched.bench.e2e [--out e2e.json] [--small]
"""

import argparse
import functools
import sys
import time

import mlx.core as mx
import numpy as np
from mlx_lm.generate import BatchGenerator, generate_step
from mlx_lm.models import llama
from mlx_lm.models.cache import KVCache, RotatingKVCache
from tqdm import tqdm

import mlx_lm_patched

from . import emit, header, parse_args
from ._sides import _fresh, _le, _peak, _ratio, _save, _switch, measure

SMALL = {
    "layers": 4,
    "hidden": 512,
    "heads": 8,
    "kv_heads": 2,
    "intermediate": 1024,
    "vocab": 1024,
    "prompts": [1000, 2000],
    "chunk": 256,
    "max_size": 512,
    "decode": 32,
    "kv_prompt": 1000,
    "batch_prompts": [600, 500, 400, 300],
    "batch_new": 16,
    "batch_max_kv": 256,
}


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


def run_single(model, args, kind, prompt, weights, kv_bits=None):
    _fresh()
    cache = _caches(args, kind)
    # Looked up now: the side being measured (patched or reverted) decides.
    quantize = functools.partial(
        sys.modules["mlx_lm.generate"].maybe_quantize_kv_cache,
        quantized_kv_start=0,
        kv_group_size=64,
        kv_bits=kv_bits,
    )
    # generate_step's prefill, one chunk at a time to see each chunk's peak:
    # all but the last token in chunks, evaluating the caches' state.
    chunk_peaks = []
    tic = time.perf_counter()
    for i in range(0, len(prompt) - 1, args.chunk):
        mx.reset_peak_memory()
        model(prompt[i : min(i + args.chunk, len(prompt) - 1)][None], cache=cache)
        quantize(cache)
        mx.eval([c.state for c in cache])
        chunk_peaks.append(_peak(weights))
    mx.reset_peak_memory()
    gen = generate_step(
        prompt[-1:],
        model,
        max_tokens=args.decode + 1,
        prompt_cache=cache,
        sampler=lambda x: mx.argmax(x, axis=-1),
        kv_bits=kv_bits,
        quantized_kv_start=0,
    )
    next(gen)
    prefill_s = time.perf_counter() - tic
    first_token_peak = _peak(weights)
    mx.reset_peak_memory()
    steps, tic = [], time.perf_counter()
    for _ in gen:
        toc = time.perf_counter()
        steps.append(toc - tic)
        tic = toc
    out = {
        "prefill_s": prefill_s,
        "prefill_tok_s": len(prompt) / prefill_s,
        "prefill_peak": max(chunk_peaks + [first_token_peak]),
        "chunk_peaks": chunk_peaks,
        "decode_tokens": len(steps),
        "decode_ms_median": 1e3 * float(np.median(steps)),
        "decode_tok_s": len(steps) / sum(steps),
        "decode_peak": _peak(weights),
        "cache_nbytes_end": sum(c.nbytes for c in cache),
    }
    del cache, gen
    _fresh()
    return out


def interleaved_decode(model, args, prompt, blocks=48, steps=16):
    """Upstream's ring and the patched one decoding side by side: each
    prefilled under its own side, then ``blocks`` blocks of ``steps`` steps,
    the sides alternating (ABBA), so both see the same drift of the device's
    clocks; the median step of each side, in ms. Each block starts on an
    idle device with one untimed step (the token ``generate_step`` computed
    ahead). ``paired``: the median over neighbouring blocks of the ratio of
    their median steps (patched over upstream), with a bootstrap 95%
    interval: whether the two sides differ by more than the noise."""
    sides = {"upstream": _switch("none"), "patched": _switch()}
    gens, times = {}, {}
    for name, switch in sides.items():
        with switch():
            gens[name] = generate_step(
                prompt,
                model,
                max_tokens=blocks * (steps + 1) + 1,
                prompt_cache=_caches(args, "rotating"),
                sampler=lambda x: mx.argmax(x, axis=-1),
                prefill_step_size=args.chunk,
            )
            next(gens[name])
        times[name] = []
    for b in tqdm(range(blocks), "decode, interleaved", unit="block", leave=False):
        for name in list(sides)[:: 1 if b % 2 else -1]:
            with sides[name]():
                mx.synchronize()
                next(gens[name])
                tic = time.perf_counter()
                for _ in range(steps):
                    next(gens[name])
                    toc = time.perf_counter()
                    times[name].append(toc - tic)
                    tic = toc
    del gens
    _fresh()
    out = {name: 1e3 * float(np.median(t)) for name, t in times.items()}
    per_block = {
        k: np.median(np.reshape(t, (blocks, steps)), 1) for k, t in times.items()
    }
    ratios = per_block["patched"] / per_block["upstream"]
    resampled = np.random.default_rng(0).choice(ratios, (2000, blocks))
    low, high = np.percentile(np.median(resampled, 1), [2.5, 97.5])
    out["paired"] = [round(float(x), 4) for x in (np.median(ratios), low, high)]
    return out


def run_batch(model, args, max_kv_size, weights, kv_bits=None):
    _fresh()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, args.vocab, n).tolist() for n in args.batch_prompts]
    quantize = {} if kv_bits is None else {"kv_bits": kv_bits, "quantized_kv_start": 0}
    gen = BatchGenerator(
        model,
        max_tokens=args.batch_new,
        stop_tokens=[],
        prefill_step_size=args.chunk,
        max_kv_size=max_kv_size,
        **quantize,
    )
    mx.reset_peak_memory()
    tic = start = time.perf_counter()
    uids = gen.insert(prompts)
    tokens = {uid: [] for uid in uids}
    steps, first = [], None
    while responses := gen.next_generated():
        toc = time.perf_counter()
        if first is None:
            first, prefill_peak = toc - start, _peak(weights)
        else:
            steps.append(toc - tic)
        tic = toc
        for r in responses:
            tokens[r.uid].append(r.token)
    total = time.perf_counter() - start
    gen.close()
    out = {
        "prefill_s": first,
        "prefill_peak": prefill_peak,
        "decode_ms_median": 1e3 * float(np.median(steps)),
        "total_s": total,
        "generated": sum(len(t) for t in tokens.values()),
        "peak": _peak(weights),
        "tokens": [tokens[u] for u in uids],
    }
    del gen
    _fresh()
    return out


def single(model, args, weights, result):
    result["single"] = {}
    for n in args.prompts:
        prompt = mx.random.randint(0, args.vocab, (n,), key=mx.random.key(n))
        mx.eval(prompt)
        run = functools.partial(run_single, model, args, prompt=prompt, weights=weights)
        sides = {
            "upstream": (_switch("none"), functools.partial(run, kind="rotating")),
            "patched": (_switch(), functools.partial(run, kind="rotating")),
            "kvcache": (_switch(), functools.partial(run, kind="kvcache")),
        }
        for patch in args.only:
            sides[f"only_{patch}"] = (
                _switch(patch),
                functools.partial(run, kind="rotating"),
            )
        r = measure(sides, args.rounds, f"single {n}")
        r["decode_interleaved_ms"] = interleaved_decode(model, args, prompt)
        p, u, k = r["patched"], r["upstream"], r["kvcache"]
        inter = r["decode_interleaved_ms"]
        r["ratios"] = {
            "patched_over_kvcache_prefill_s": _ratio(p, k, "prefill_s"),
            "patched_over_kvcache_prefill_peak": _ratio(p, k, "prefill_peak"),
            "patched_over_kvcache_decode_peak": _ratio(p, k, "decode_peak"),
            "patched_over_upstream_decode_ms": _ratio(p, u, "decode_ms_median"),
            "patched_over_upstream_decode_ms_interleaved": round(
                inter["patched"] / inter["upstream"], 3
            ),
            # Block by block: the median ratio and its 95% interval.
            "patched_over_upstream_decode_ms_paired": inter["paired"],
            "upstream_over_kvcache_prefill_s": _ratio(u, k, "prefill_s"),
            "upstream_over_kvcache_prefill_peak": _ratio(u, k, "prefill_peak"),
        }
        q = r["ratios"]
        r["targets"] = {
            "prefill_le_1.1x_kvcache": _le(q["patched_over_kvcache_prefill_s"], 1.1),
            "peak_le_kvcache": _le(q["patched_over_kvcache_prefill_peak"], 1)
            and _le(q["patched_over_kvcache_decode_peak"], 1),
            "decode_median_le_upstream": _le(
                q["patched_over_upstream_decode_ms_interleaved"], 1
            ),
        }
        result["single"][str(n)] = r
        _save(result, args.out)


def quantized(model, args, weights, result):
    prompt = mx.random.randint(
        0, args.vocab, (args.kv_prompt,), key=mx.random.key(args.kv_prompt)
    )
    mx.eval(prompt)
    run = functools.partial(run_single, model, args, prompt=prompt, weights=weights)
    sides = {}
    for kind in ("rotating", "kvcache"):
        sides[f"{kind}_bf16"] = (_switch(), functools.partial(run, kind=kind))
        for bits in args.kv_bits:
            sides[f"{kind}_q{bits}"] = (
                _switch(),
                functools.partial(run, kind=kind, kv_bits=bits),
            )
        # Upstream's at the first kv_bits only: on CUDA every kv_bits fails
        # alike, each after 90 s.
        sides[f"upstream_{kind}_q{args.kv_bits[0]}"] = (
            _switch("none"),
            functools.partial(run, kind=kind, kv_bits=args.kv_bits[0]),
        )
    for max_kv in (None, args.batch_max_kv):
        batch_run = functools.partial(run_batch, model, args, max_kv, weights)
        sides[f"batch_{max_kv}_bf16"] = (_switch(), batch_run)
        for bits in args.kv_bits:
            sides[f"batch_{max_kv}_q{bits}"] = (
                _switch(),
                functools.partial(batch_run, kv_bits=bits),
            )
    r = measure(sides, args.rounds, f"quantized {args.kv_prompt}")
    for name in sides:
        r[name].pop("tokens", None)
    r["ratios"], r["targets"] = {}, {}
    kinds = ("rotating", "kvcache", "batch_None", f"batch_{args.batch_max_kv}")
    for kind in kinds:
        for bits in args.kv_bits:
            name = f"{kind}_q{bits}"
            ratio = _ratio(r[name], r[f"{kind}_bf16"], "prefill_peak")
            r["ratios"][f"{name}_over_bf16_prefill_peak"] = ratio
            r["ratios"][f"{name}_over_bf16_decode_ms"] = _ratio(
                r[name], r[f"{kind}_bf16"], "decode_ms_median"
            )
            r["targets"][f"{name}_prefill_peak_lt_bf16"] = _le(ratio, 0.999)
    result["quantized"] = r
    _save(result, args.out)


def batch(model, args, weights, result):
    # All four in one alternating measurement: the bounded/unbounded ratio
    # compares rounds taken side by side.
    sides = {}
    for max_kv in (None, args.batch_max_kv):
        run = functools.partial(run_batch, model, args, max_kv, weights)
        sides[f"upstream {max_kv}"] = (_switch("none"), run)
        sides[f"patched {max_kv}"] = (_switch(), run)
    runs = measure(sides, max(args.rounds, args.batch_rounds), "batch")
    keys = ("prefill_s", "prefill_peak", "decode_ms_median", "peak")
    result["batch"] = {}
    for max_kv in (None, args.batch_max_kv):
        p, u = runs[f"patched {max_kv}"], runs[f"upstream {max_kv}"]
        r = {
            "upstream": u,
            "patched": p,
            "ratios": {f"patched_over_upstream_{k}": _ratio(p, u, k) for k in keys},
            "tokens_match_upstream": "error" not in p
            and "error" not in u
            and p["tokens"] == u["tokens"],
        }
        result["batch"][f"max_kv_size={max_kv}"] = r
    bounded = runs[f"patched {args.batch_max_kv}"]
    unbounded = runs["patched None"]
    ratios = {k: _ratio(bounded, unbounded, k) for k in keys}
    for side in runs.values():
        side.pop("tokens", None)
    result["batch"]["bounded_over_unbounded"] = ratios
    result["batch"]["targets"] = {
        "bounded_le_unbounded": all(_le(ratios[k], 1) for k in keys)
    }
    _save(result, args.out)


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_lm_patched.bench.e2e",
        description="Random-weight Llama-8B shape: caches end to end.",
    )
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument("--small", action="store_true", help="a CPU-sized run")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--prompts", type=ints, default=[6000, 16000, 32000])
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--max-size", type=int, default=4096)
    p.add_argument("--keep", type=int, default=4)
    p.add_argument("--decode", type=int, default=128)
    p.add_argument("--kv-prompt", type=int, default=16000)
    p.add_argument("--kv-bits", type=ints, default=[4, 8])
    p.add_argument("--batch-prompts", type=ints, default=[3000, 2500, 2000, 1500])
    p.add_argument("--batch-new", type=int, default=64)
    p.add_argument("--batch-max-kv", type=int, default=2048)
    p.add_argument(
        "--scenarios",
        type=lambda s: s.split(","),
        default=["single", "quantized", "batch"],
    )
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="measured runs per case, in alternating order, after a warm-up",
    )
    p.add_argument(
        "--batch-rounds",
        type=int,
        default=5,
        help="rounds of the batch scenario (at least --rounds)",
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
    parser = build_parser()
    args = parse_args(parser, argv)
    if args.small:  # CPU sizes, unless given on the command line
        given = parser.parse_args(argv)
        for k, v in SMALL.items():
            if getattr(given, k) == parser.get_default(k):
                setattr(args, k, v)
    model = build_model(args)
    _fresh()
    weights = mx.get_active_memory()
    result = {
        **header("e2e", [p.name for p in mlx_lm_patched.PATCHES]),
        "config": vars(args),
        "weights_bytes": weights,
    }
    scenarios = {"single": single, "quantized": quantized, "batch": batch}
    for name in args.scenarios:
        scenarios[name](model, args, weights, result)
    mlx_lm_patched.apply()
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
