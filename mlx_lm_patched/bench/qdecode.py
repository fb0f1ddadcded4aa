"""Quantized decode on CUDA: the kernel over the packed cache against the
bfloat16 cache and against fused attention over dequantized keys.

Its parts, one JSON:

- ``check``: the kernel (``quantized_decode_attention``) against fused
  attention over dequantized keys (the old road) and against
  ``decode_attention_reference`` computed on the GPU in float32, over head
  dims, group sizes, bits, GQA ratios, query counts and masks (none, a
  wrapped ring's boolean mask, an additive one, a padded batch's, causal):
  ``rel`` is ||kernel - other|| / ||other||; tolerances: 5e-3 against the
  reference (the output rounded to bfloat16), 2e-2 against the old road
  (which also rounds keys, values and probabilities to bfloat16); then a
  ``QuantizedKVCache``'s decode steps, past a flush of its tail, the kernel
  writing the tail (``_check_written_tail``).
- ``attention``: one decode step's attention alone, 32 layers' caches of
  the Llama-8B shape (32 query heads over 8, head dim 128), per layer:
  kernel, old road, and ``mx.fast.scaled_dot_product_attention`` over a
  bfloat16 cache; the kernel at several ``TARGET_BLOCKS`` and query counts.
- ``e2e``: each side in its own process (``--side``), the sides' processes
  side by side, taking turns: a random-weight Llama-8B shape
  (``e2e.build_model``), ``generate_step`` with each ``--prompts`` length,
  ``--chunk``-token prefill steps, ``--decode`` greedy tokens, once to warm
  up and ``--rounds`` times measured (the median decode tokens/s). Sides:
  ``bf16`` (``KVCache``), ``q8`` and ``q4`` (``--kv-bits``, the kernel),
  ``q8_old`` and ``q4_old`` (``MLX_LM_PATCHED_DECODE_KERNEL=0``: the old
  road, measured once, after the others).
  Decode tokens/s, prefill seconds, the prefill's peak above the weights,
  whether the greedy tokens equal the old road's, and one more step's host
  build, launch and whole (``step_host_ms``, ``step_launch_ms``,
  ``step_synced_ms``: where build + launch reaches a step, the host bounds
  decode).
- ``turns``: decode tokens/s of ``bf16``, ``q8`` and ``q4`` in one process,
  the sides taking turns ``--rounds`` times (each side's median), as
  ``e2e`` runs them otherwise.
- ``host``: a decode step's host time, the sides in one process taking
  turns a step at a time: build, launch and whole (medians of
  ``--steps``), and a layer's cache update and attention call alone.
- ``memory``: each side's decode memory, in one process: after a prompt
  and two tokens, ``--steps`` greedy steps pipelined as ``generate_step``
  runs them (the next step launched before the last token is read) and
  again each step synced; the peak above the active memory at their start
  and tokens/s. On CUDA a bfloat16 ``KVCache`` write meeting the last
  step still in flight copies the layer's whole buffer (MLX donates only
  what nothing else holds; the backend holds a graph's inputs until it
  has run): pipelined, its peak grows by most of the cache.
- ``steps``: a decode step's caches and attention alone, 32 layers
  (``_qdecode_timing.layer_steps``).

    python -m mlx_lm_patched.bench qdecode [--out qdecode.json] [--parts check,attention,e2e]
"""

import argparse
import itertools
import json
import os
import sys
import time

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.kernels import quantized_decode as qa
from mlx_lm.models import base
from mlx_lm.models.cache import make_prompt_cache

import mlx_lm_patched

from . import emit, header, parse_args
from ._qdecode_check import check
from ._qdecode_e2e import SIDES, e2e
from ._qdecode_timing import _fastest, _settings, attention, layer_steps
from .e2e import _fresh, _peak, build_model


def _greedy(model, prompt, args, kv_bits, cache, tokens=None, marks=None):
    """``generate_step`` as every side runs it: greedy, the cache quantized
    from the first token (``kv_bits``), ``--chunk``-token prefill steps,
    ``--decode`` tokens (or ``tokens``); ``marks`` gets the time at each
    prefill progress call."""
    progress = None if marks is None else lambda *_: marks.append(time.perf_counter())
    return generate_step(
        prompt,
        model,
        prompt_cache=cache,
        max_tokens=tokens or args.decode,
        sampler=lambda x: mx.argmax(x, axis=-1),
        kv_bits=kv_bits,
        kv_group_size=64,
        quantized_kv_start=0,
        prefill_step_size=args.chunk,
        prompt_progress_callback=progress,
    )


def _step_times(model, token, cache):
    """Seconds to build a decode step of ``token``, to launch it
    (``mx.async_eval``'s call) and the whole step, synced."""
    mx.synchronize()
    tic = time.perf_counter()
    logits = model(mx.array([[token]]), cache=cache)
    built = time.perf_counter()
    mx.async_eval(logits)
    launched = time.perf_counter()
    mx.eval(logits)
    return built - tic, launched - built, time.perf_counter() - tic


def run_side(args):
    """One side in this process, driven by ``e2e`` over stdin, a JSON line a
    request, each answered by one on stdout: ``{"prompt": n}`` prefills a
    prompt of n tokens (the first time at a length after a run of 80
    tokens to warm up: every path compiled, the tail's first flush, at 64,
    included) and answers
    its prefill; ``{"decode": k}`` decodes its next k tokens, synced;
    ``{"end": true}`` answers the run's figures."""
    kv_bits, _ = SIDES[args.side]
    _settings(args.kt, args.blocks, args.pf)
    mx.random.seed(0)  # every side's process, the same weights
    model = build_model(args)
    _fresh()
    weights = mx.get_active_memory()
    warm = set()
    for line in sys.stdin:
        ask = json.loads(line)
        if "prompt" in ask:
            n = ask["prompt"]
            prompt = mx.random.randint(0, args.vocab, (n,), key=mx.random.key(n))
            if n not in warm:
                warm.add(n)
                cache, warm_tokens = make_prompt_cache(model), min(80, args.decode)
                for _ in _greedy(model, prompt, args, kv_bits, cache, warm_tokens):
                    pass
            _fresh()
            mx.reset_peak_memory()
            tic = time.perf_counter()
            marks = [tic]  # and one a prefill progress call
            cache = make_prompt_cache(model)
            gen = _greedy(model, prompt, args, kv_bits, cache, marks=marks)
            tokens, steps, decode_s = [next(gen)[0]], [], 0.0
            prefill_s = time.perf_counter() - tic
            answer = {"prefill_s": round(prefill_s, 4), "prefill_peak": _peak(weights)}
            # Each chunk's seconds (the first's with the cache's conversion),
            # then the first token's step.
            chunks = np.diff(marks[:1] + marks[2:])
            answer["prefill_chunks_s"] = [round(float(x), 4) for x in chunks]
        elif "decode" in ask:
            start = tic = time.perf_counter()
            for t, _ in itertools.islice(gen, ask["decode"]):
                tokens.append(t)
                steps.append(time.perf_counter() - tic)
                tic = time.perf_counter()
            mx.synchronize()  # the next step, launched, is this segment's
            seconds = time.perf_counter() - start
            decode_s += seconds
            answer = {"decoded": len(tokens) - 1, "seconds": round(seconds, 5)}
        else:
            answer = _side_figures(model, cache, tokens, steps, decode_s)
            if args.side.endswith("_old"):
                answer["top2_margins"] = _old_road_margins(args, model, prompt, kv_bits)
            print(
                f"[qdecode] {args.side} {n} {answer['decode_tok_s']} tok/s",
                file=sys.stderr,
            )
            del gen, cache
        print(json.dumps(answer), flush=True)


def _side_figures(model, cache, tokens, steps, decode_s):
    """A run's decode figures and tokens, and one more step's by hand: the
    host's time to build it, to launch it (``mx.async_eval``'s call), then
    the whole. A pipelined step takes about build + launch where the host
    bounds it."""
    host, launch, step = zip(
        *(_step_times(model, tokens[-1], cache) for _ in range(10))
    )
    return {
        "step_host_ms": round(1e3 * float(np.median(host)), 3),
        "step_launch_ms": round(1e3 * float(np.median(launch)), 3),
        "step_synced_ms": round(1e3 * float(np.median(step)), 3),
        "decode_tok_s": round((len(tokens) - 1) / decode_s, 2),
        "decode_tok_s_median_step": round(1 / float(np.median(steps)), 2),
        # Where the mean and the median part: the slowest steps (index, ms).
        "step_ms_p90": round(1e3 * float(np.percentile(steps, 90)), 3),
        "slow_steps": [
            (i, round(1e3 * s, 2))
            for i, s in enumerate(steps)
            if s > 1.5 * np.median(steps)
        ][:20],
        "tokens": tokens,
    }


def _old_road_margins(args, model, prompt, kv_bits):
    """How close the old road's picks were: the gap between each step's two
    best log-probabilities."""
    gen = _greedy(model, prompt, args, kv_bits, make_prompt_cache(model))
    margins = []
    for _, logprobs in gen:
        top = mx.topk(logprobs, 2)
        margins.append(round(abs(top[0] - top[1]).item(), 5))
    return margins


def _one_process(args):
    """The model, the sides that can share a process (not the old road's:
    its switch is read at import) and each ``(length, prompt)``."""
    mx.random.seed(0)
    model = build_model(args)
    sides = [s for s in args.sides if SIDES[s][1] == "1"]
    keys = (mx.random.key(n) for n in args.prompts)
    prompts = [
        (n, mx.random.randint(0, args.vocab, (n,), key=k))
        for n, k in zip(args.prompts, keys)
    ]
    return model, sides, prompts


def turns(args):
    """Decode tokens/s of the sides in one process, over one model, the sides
    taking turns ``--rounds`` times after a round to warm up: a side's
    median. Between processes a side's speed moved by up to 20% (the host's
    share of a step); within one, the sides meet the same host. Sides of
    the old road are left to ``e2e``."""
    model, sides, prompts = _one_process(args)
    out = {}
    for n, prompt in prompts:
        runs = {s: [] for s in sides}
        for r in range(args.rounds + 1):
            for side in sides:
                _fresh()
                gen = _greedy(
                    model, prompt, args, SIDES[side][0], make_prompt_cache(model)
                )
                next(gen)
                tic, count = time.perf_counter(), sum(1 for _ in gen)
                if r:
                    runs[side].append(round(count / (time.perf_counter() - tic), 2))
                del gen
        row = {
            s: {"decode_tok_s": float(np.median(v)), "rounds": v}
            for s, v in runs.items()
        }
        if "bf16" in row:
            for s in sides:
                row[s]["over_bf16"] = round(
                    row[s]["decode_tok_s"] / row["bf16"]["decode_tok_s"], 3
                )
        out[str(n)] = row
        print(f"[qdecode] turns {n} {row}", file=sys.stderr, flush=True)
    return out


def host(args):
    """A decode step's host time, the sides in one process over one model
    (their caches prefilled alike), taking turns a step at a time: the
    median ms to build a step (``build``), to launch it (``launch``,
    ``mx.async_eval``'s call), the whole, synced (``synced``), and what the
    step waits after its launch (``after``); then, us a call over the first
    layer's cache, ``--layers`` times its update (``update_us``) and the
    attention call over that update (``attention_us``: each the call a
    cache's decode step makes, its tail written by the kernel). Where
    build + launch exceeds the GPU's time a step, the host bounds decode.
    On CUDA with
    ``MLX_MAX_OPS_PER_BUFFER=1000000 MLX_MAX_MB_PER_BUFFER=1000000`` (kept
    in the JSON) a step is one CUDA graph, launched as ``mx.async_eval``
    returns: ``after`` is then its GPU time, in situ (ncu times kernels one
    at a time from cold caches)."""
    model, sides, prompts = _one_process(args)
    graphs = ("MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER")
    out = {"env": {k: os.environ.get(k) for k in graphs}}
    for n, prompt in prompts:
        caches, tokens, res = {}, {}, {s: ([], [], [], []) for s in sides}
        for side in sides:
            caches[side] = make_prompt_cache(model)
            gen = _greedy(model, prompt, args, SIDES[side][0], caches[side], 8)
            tokens[side] = list(gen)[-1][0]
        for step in range(args.steps + 3):  # 3 to warm up
            for side in sides:
                times = _step_times(model, tokens[side], caches[side])
                times += (times[2] - times[0] - times[1],)  # after its launch
                if step >= 3:
                    for series, t in zip(res[side], times):
                        series.append(t)
        x = mx.random.normal((1, args.heads, 1, args.hidden // args.heads))
        kv = mx.random.normal((1, args.kv_heads, 1, args.hidden // args.heads))
        x, kv = x.astype(mx.bfloat16), kv.astype(mx.bfloat16)
        row = {}
        for side in sides:
            c, calls, update, attend = caches[side][0], args.layers, 0.0, 0.0
            for _ in range(calls):  # as a step's layer: an update, its attention
                tic = time.perf_counter()
                k, v = c.update_and_fetch(kv, kv)
                updated = time.perf_counter()
                o = base.scaled_dot_product_attention(x, k, v, c, 0.088, None)
                update += updated - tic
                attend += time.perf_counter() - updated
            mx.eval(o, k, v)
            med = [round(1e3 * float(np.median(x)), 3) for x in res[side]]
            names = ("build_ms", "launch_ms", "synced_ms", "after_ms")
            row[side] = dict(zip(names, med))
            row[side]["update_us"] = round(1e6 * update / calls, 2)
            row[side]["attention_us"] = round(1e6 * attend / calls, 2)
        out[str(n)] = row
        print(f"[qdecode] host {n} {row}", file=sys.stderr, flush=True)
    return out


def _decode_steps(model, cache, token, steps, pipelined):
    """``steps`` greedy tokens after ``token``: pipelined (the next step
    launched before the last token is read, as ``generate_step`` does) or
    each step evaluated before the next is built."""
    y, tokens = mx.array([token]), []
    for i in range(steps):
        nxt = mx.argmax(model(y[None], cache=cache)[:, -1, :], axis=-1)
        if pipelined:
            mx.async_eval(nxt)
            if i:  # the last step's token, read while this one runs
                tokens.append(y.item())
        else:
            tokens.append(nxt.item())
        y = nxt
    if pipelined:
        tokens.append(y.item())
    return tokens


def memory(args):
    """Each side's decode memory and speed, pipelined and synced
    (``_decode_steps``), from a cache that has the prompt and two tokens:
    the peak above the active memory at the start (``peak_over_start``,
    bytes), tokens/s and whether both ways gave the same tokens."""
    model, sides, prompts = _one_process(args)
    out = {}
    for n, prompt in prompts:
        row = {}
        for side in sides:
            fig, tokens = {}, {}
            for way in ("pipelined", "synced"):
                cache = make_prompt_cache(model)
                gen = _greedy(model, prompt, args, SIDES[side][0], cache, 2)
                token = list(gen)[-1][0]
                _fresh()
                start = mx.get_active_memory()
                mx.reset_peak_memory()
                tic = time.perf_counter()
                tokens[way] = _decode_steps(
                    model, cache, token, args.steps, way == "pipelined"
                )
                seconds = time.perf_counter() - tic
                fig[f"{way}_peak_over_start"] = mx.get_peak_memory() - start
                fig[f"{way}_tok_s"] = round(args.steps / seconds, 2)
                fig["cache_nbytes"] = sum(c.nbytes for c in cache)
                del cache, gen
            fig["same_tokens"] = tokens["pipelined"] == tokens["synced"]
            row[side] = fig
        out[str(n)] = row
        print(f"[qdecode] memory {n} {row}", file=sys.stderr, flush=True)
    return out


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_lm_patched.bench.qdecode",
        description="Quantized decode on CUDA: kernel, old road, bfloat16.",
    )
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    p.add_argument(
        "--parts", type=lambda s: s.split(","), default=["check", "attention", "e2e"]
    )
    p.add_argument("--sides", type=lambda s: s.split(","), default=list(SIDES))
    p.add_argument("--side", choices=list(SIDES), help="run one side here (a child)")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=14336)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompts", type=ints, default=[4096, 16384, 32768])
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--decode", type=int, default=256)
    p.add_argument("--segment", type=int, default=32, help="e2e: decode tokens a turn")
    p.add_argument("--rounds", type=int, default=1, help="e2e, turns: a side's runs")
    p.add_argument(
        "--fresh", action="store_true", help="e2e: new sides' processes each round"
    )
    p.add_argument("--steps", type=int, default=30, help="host, memory: steps a side")
    p.add_argument("--blocks", type=int, default=qa.DECODE_BLOCKS)
    p.add_argument("--kt", type=int, default=qa.DECODE_KEYS_PER_ITER)
    p.add_argument("--pf", type=int, default=int(qa.DECODE_PREFETCH))
    p.add_argument(
        "--tune",
        action="store_true",
        help="the e2e sides take the kernel settings fastest in 'attention'",
    )
    p.add_argument("--device", choices=["cpu", "gpu"], help="default: MLX's")
    p.add_argument("--out", help="also write the JSON to this file")
    return p


def main(argv=None):
    args = parse_args(build_parser(), argv)
    mlx_lm_patched.apply()
    if args.side:
        print(json.dumps(run_side(args)))
        return
    result = {**header("qdecode", [p.name for p in mlx_lm_patched.PATCHES])}
    result["config"] = vars(args)
    parts = {
        "check": check,
        "attention": attention,
        "steps": layer_steps,
        "e2e": e2e,
        "turns": turns,
        "host": host,
        "memory": memory,
    }
    for name in args.parts:
        result[name] = parts[name](args)
        if name == "attention" and args.tune:
            args.kt, args.blocks, args.pf = _fastest(result[name])
            result["tuned"] = {"kt": args.kt, "blocks": args.blocks, "pf": args.pf}
            _settings(args.kt, args.blocks, args.pf)
            result["check_tuned"] = check(args)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
