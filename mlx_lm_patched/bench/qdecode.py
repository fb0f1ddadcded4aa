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
import subprocess
import sys
import tempfile
import time

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models import base
from mlx_lm.models import cache as cache_module
from mlx_lm.models.cache import make_prompt_cache

import mlx_lm_patched
from mlx_lm_patched.kernels import quantized_decode_kernel as qa
from mlx_lm_patched.kernels.quantized_decode_reference import decode_attention_reference

from . import emit, header, parse_args
from ._qdecode_timing import (
    _cache,
    _fastest,
    _rel,
    _settings,
    attention,
    layer_steps,
    old_road,
)
from .e2e import _fresh, _peak, build_model

SIDES = {
    "bf16": (None, "1"),
    "q8": (8, "1"),
    "q4": (4, "1"),
    "q8_old": (8, "0"),
    "q4_old": (4, "0"),
}


def check(args):
    rng = np.random.default_rng(0)
    rows, worst = [], {"reference": 0.0, "old_road": 0.0}
    cases = []
    for D in (64, 80, 96, 128):
        for gs in (32, 64, 128):
            for bits in (4, 8):
                cases.append((D, gs, bits, 4, 1, "none", 1))
    for mask in ("ring", "additive", "batch", "causal"):
        for n_rep in (1, 4, 8):
            cases.append((128, 64, 8, n_rep, 1, mask, 2 if mask == "batch" else 1))
            cases.append((96, 32, 4, n_rep, 1, mask, 2 if mask == "batch" else 1))
    for L in (2, 4, 8):
        cases.append((128, 64, 8, 4, L, "causal", 1))
        cases.append((128, 64, 4, 4, L, "batch", 2))
    cases = [c + (0,) for c in cases]
    # A QuantizedKVCache's decode tail: its last keys in bfloat16.
    for D in (64, 80, 96, 128):
        for bits in (4, 8):
            for tail in (1, 37, 64):
                cases.append((D, 32 if D % 64 else 64, bits, 4, 1, "none", 1, tail))
    for L, kind in ((4, "causal"), (2, "batch"), (1, "ring"), (1, "additive")):
        cases.append((128, 64, 8, 4, L, kind, 2 if kind == "batch" else 1, 9))
    for D, gs, bits, n_rep, L, kind, B, tail in cases:
        n_kv, kL = 2, 3000 + int(rng.integers(0, 1000))
        if ((D + 31) // 32 * 32 if D % gs else D) % gs:
            continue  # QuantizedKVCache picks a smaller group size
        q_keys, q_values = _cache(rng, B, n_kv, kL, D, gs, bits)
        if tail:
            q_keys, q_values = _with_tail(rng, q_keys, q_values, tail, D)
        queries = mx.array(
            rng.standard_normal((B, n_kv * n_rep, L, D)).astype(np.float32)
        )
        queries = queries.astype(mx.bfloat16)
        mask = None
        if kind == "ring":  # a wrapped ring: sinks, then the window from its start
            idx = mx.arange(kL)
            mask = ((idx < 4) | (idx >= 1000 + 4) | (idx < 900))[None]
        elif kind == "additive":
            mask = mx.array(rng.standard_normal((1, 1, L, kL)).astype(np.float32))
            mask = mask.astype(mx.bfloat16)
        elif kind == "batch":  # left padding, row 1 padded by 1500
            pad = mx.array([0, 1500])[:, None, None, None]
            causal = mx.arange(kL) <= mx.arange(kL - L, kL)[:, None]
            mask = (mx.arange(kL) >= pad) & causal
        elif kind == "causal":
            mask = "causal"
        splits = qa.decode_splits(
            B, n_kv, q_keys[0].shape[2], -(-n_rep * L // base.DECODE_ROWS)
        )
        out = qa.quantized_decode_attention(
            queries, q_keys, q_values, 0.088, mask, gs, bits, splits
        )
        ref = decode_attention_reference(
            queries, q_keys, q_values, 0.088, mask, gs, bits, splits
        )
        m = mask
        if kind == "causal":
            m = mx.arange(kL - L, kL)[:, None] >= mx.arange(kL)[None]
        if tail:  # the old road quantizes the tail
            q_keys, q_values = base._quantize_tail(q_keys, q_values, gs, bits)
        old = old_road(queries, q_keys, q_values, 0.088, m, gs, bits)
        finite = mx.all(mx.isfinite(out)).item()
        r = {
            "D": D,
            "gs": gs,
            "bits": bits,
            "n_rep": n_rep,
            "L": L,
            "mask": kind,
            "B": B,
            "kL": kL,
            "tail": tail,
            "splits": splits,
            "finite": finite,
            "rel_reference": _rel(out, ref.astype(mx.float32)),
            "rel_old_road": _rel(out, old),
        }
        r["ok"] = finite and r["rel_reference"] <= 5e-3 and r["rel_old_road"] <= 2e-2
        worst["reference"] = max(worst["reference"], r["rel_reference"])
        worst["old_road"] = max(worst["old_road"], r["rel_old_road"])
        rows.append(r)
        print(f"[qdecode] check {r}", file=sys.stderr, flush=True)
    for D, bits, L in ((128, 8, 1), (128, 4, 1), (64, 8, 3), (80, 4, 2), (96, 8, 1)):
        r = _check_written_tail(rng, D, bits, L)
        worst["reference"] = max(worst["reference"], r["rel_reference"])
        rows.append(r)
        print(f"[qdecode] check {r}", file=sys.stderr, flush=True)
    return {"cases": rows, "all_ok": all(r["ok"] for r in rows), "worst_rel": worst}


def _check_written_tail(rng, D, bits, L, n_kv=2, n_rep=4, prompt=1500, steps=70):
    """A ``QuantizedKVCache``'s decode steps through the kernel, which writes
    its tail with each step's tokens (``_TailFetch``), past a flush: each
    step's output against the reference over the lazily written tail, and
    the cache's tokens against a tailless cache's fed the same (equal)."""

    def rand(*shape):
        x = rng.standard_normal(shape).astype(np.float32)
        return mx.array(x).astype(mx.bfloat16)

    on, off = cache_module.QuantizedKVCache(bits=bits), cache_module.QuantizedKVCache(
        bits=bits
    )
    on.decode_tail, off.decode_tail = 64, 0
    k, v = rand(1, n_kv, prompt, D), rand(1, n_kv, prompt, D)
    for c in (on, off):
        c.update_and_fetch(k, v)
    worst, adopted = 0.0, 0
    for _ in range(steps):
        k, v, q = rand(1, n_kv, L, D), rand(1, n_kv, L, D), rand(1, n_kv * n_rep, L, D)
        off.update_and_fetch(k, v)
        q_keys, q_values = on.update_and_fetch(k, v)
        splits = qa.decode_splits(1, n_kv, q_keys[0].shape[2])
        ref = decode_attention_reference(
            q, q_keys, q_values, 0.088, "causal", on.group_size, bits, splits
        )
        # (before: off CUDA this scales q in place, as upstream's does)
        out = base.quantized_scaled_dot_product_attention(
            q, q_keys, q_values, 0.088, "causal", on.group_size, bits
        )
        adopted += on._step is None  # the kernel's tail taken
        worst = max(worst, _rel(out, ref.astype(mx.float32)))
    same = all(
        mx.array_equal(x, y).item()
        for x, y in zip((*on.keys, *on.values), (*off.keys, *off.values))
    )
    r = {"D": D, "bits": bits, "L": L, "written_tail": steps, "kL": on.offset}
    r["flushes"] = steps * L // on.decode_tail
    r.update(rel_reference=worst, adopted=adopted, same_as_tailless=same)
    r["ok"] = worst <= 5e-3 and adopted == steps and same
    return r


def _with_tail(rng, q_keys, q_values, tail, D):
    """The keys and values as a ``QuantizedKVCache`` decode step hands them
    out: whole buffers (room past the packed keys), its ``tail`` last keys
    new ones in bfloat16 in a buffer of 64 (the rest garbage), the lengths."""
    kL = q_keys[0].shape[2]
    lengths = cache_module._decode_lengths(kL - tail, tail)
    out = []
    for parts in (q_keys, q_values):
        shape = (*parts[0].shape[:2], 64, D)
        rest = mx.array(rng.standard_normal(shape).astype(np.float32))
        pad = [(0, 0), (0, 0), (0, 300), (0, 0)]
        packed = [mx.pad(x[:, :, : kL - tail], pad) for x in parts]
        out.append((*packed, rest.astype(mx.bfloat16), lengths))
    return out


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


def _start_side(args, side):
    """A side's process (``run_side``): its model built, waiting for
    requests; its stderr kept in a file (``err``) for a failure's message."""
    env = dict(os.environ, MLX_LM_PATCHED_DECODE_KERNEL=SIDES[side][1])
    argv = [sys.executable, "-m", __name__, "--side", side]
    argv += ["--decode", str(args.decode), "--chunk", str(args.chunk)]
    argv += ["--blocks", str(args.blocks), "--kt", str(args.kt)]
    argv += ["--pf", str(int(args.pf))]
    for k in ("layers", "hidden", "heads", "kv_heads", "intermediate"):
        argv += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    argv += ["--vocab", str(args.vocab)]
    err = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err
    )
    proc.err = err
    return proc


def _ask(proc, ask):
    """A side's answer to one request (``run_side``), or its error."""
    try:
        proc.stdin.write((json.dumps(ask) + "\n").encode())
        proc.stdin.flush()
        for line in proc.stdout:
            if line.startswith(b"{"):
                return json.loads(line)
    except BrokenPipeError:
        pass
    proc.wait()
    proc.err.seek(0)
    return {"error": proc.err.read()[-500:]}


def _stop_sides(procs):
    """End the sides' processes (they leave their loop at stdin's end)."""
    for proc in procs.values():
        try:
            proc.stdin.close()
        except BrokenPipeError:  # gone already, a request unsent
            pass
        proc.wait()
        proc.err.close()


def _run_sides(args, procs, order, n):
    """One run of each side at a prompt of ``n`` tokens: every side
    prefills, then their decodes take turns ``--segment`` tokens at a time
    (each turn the other way round). A side's answers, or its error."""
    got = {s: _ask(procs[s], {"prompt": n}) | {"turns_s": []} for s in order}
    left = args.decode - 1  # the prefill gave the first token
    while left > 0:
        for side in order:
            if "error" not in got[side]:
                answer = _ask(procs[side], {"decode": min(args.segment, left)})
                if "error" in answer:
                    got[side] = answer
                else:
                    got[side]["turns_s"].append(answer["seconds"])
        left -= args.segment
        order = order[::-1]
    for side in order:
        if "error" not in got[side]:
            got[side] |= _ask(procs[side], {"end": True})
    return got


def e2e(args):
    """Each side in a process of its own, the sides' processes all started
    at once (each builds the model) and run side by side: a prompt at a
    time, the sides prefill, then decode in turns of ``--segment`` tokens,
    ``--rounds`` times (every other round in reverse). On the GPU machine
    the host ran in fast and slow spells of about a second (decode steps
    of 4.8 and 7.4 ms, bfloat16 at 4k), each vCPU its own: run on one core
    (``taskset -c N``), the sides' turns meet them alike (their rounds then
    moved together), where runs one after another met them by chance. A
    side's decode tokens/s and prefill seconds are its medians over the
    rounds, the rest its first round's; its ratios to bfloat16's are also
    taken turn by turn (``_paired``), which the targets read. A process's
    host ran at its own speed for all its rounds (H200, one call: q8 at
    0.95-0.96x bfloat16 at every length, paired, q4 at 0.99-1.01x): with
    ``--fresh`` each round starts the sides' processes anew, so their
    rounds' medians take several processes a side. The old road's
    sides run once, after the others (their tokens), each alone. With
    ``--out``, the finished rounds' summary goes to ``<out>.partial`` after
    each round (a run cut off keeps them), removed once all are done."""
    sides, partial = {}, args.out and args.out + ".partial"
    kernel = [s for s in args.sides if not s.endswith("_old")]
    procs = {s: _start_side(args, s) for s in kernel}
    try:
        for round_ in range(args.rounds):
            if round_ and partial:
                with open(partial, "w") as f:
                    summary = _e2e_summary(args, sides)
                    json.dump({"rounds_done": round_, "e2e": summary}, f)
            if round_ and args.fresh:
                _stop_sides(procs)
                procs = {s: _start_side(args, s) for s in kernel}
            for n in args.prompts:
                order = kernel[:: -1 if round_ % 2 else 1]
                for side, got in _run_sides(args, procs, order, n).items():
                    _add_round(sides, side, n, got)
    finally:
        _stop_sides(procs)
    for side in (s for s in args.sides if s.endswith("_old")):
        procs = {side: _start_side(args, side)}
        try:
            for n in args.prompts:
                _add_round(sides, side, n, _run_sides(args, procs, [side], n)[side])
        finally:
            _stop_sides(procs)
    if partial and os.path.exists(partial):
        os.remove(partial)
    return _e2e_summary(args, sides)


def _add_round(sides, side, n, got):
    """Keep a side's first figures for ``n``; medians over its rounds of
    decode tokens/s and prefill seconds."""
    row = sides.setdefault(side, {}).setdefault(str(n), got)
    if "decode_tok_s" in got and "decode_tok_s" in row:
        for k in ("decode_tok_s", "prefill_s", "turns_s"):
            row.setdefault(f"{k}_rounds", []).append(got[k])
        for k in ("decode_tok_s", "prefill_s"):
            row[k] = float(np.median(row[f"{k}_rounds"]))


def _paired(side, row, bf16):
    """A side's decode and prefill against bfloat16's turn by turn: the
    medians over the rounds' turns of bfloat16's seconds over the side's
    (the same tokens: tokens/s over tokens/s), and over the rounds of its
    prefill seconds over bfloat16's. Turns next to each other in time meet
    the host's spells alike, where whole rounds each met their own."""
    turns = [row.get("turns_s_rounds"), bf16.get("turns_s_rounds")]
    if not all(turns) or [len(x) for x in turns[0]] != [len(x) for x in turns[1]]:
        return {}
    decode = [b / a for a, b in zip(*(sum(t, []) for t in turns))]
    prefill = zip(row["prefill_s_rounds"], bf16["prefill_s_rounds"])
    return {
        f"{side}_over_bf16_decode_paired": round(float(np.median(decode)), 3),
        f"{side}_over_bf16_prefill_paired": round(
            float(np.median([a / b for a, b in prefill])), 3
        ),
    }


def _e2e_summary(args, sides):
    """Each length's sides, their ratios to bfloat16's and #29's targets."""
    out = {}
    for n in map(str, args.prompts):
        row = {s: dict(sides[s].get(n, sides[s])) for s in sides}
        bf16 = row.get("bf16", {})
        ratios, targets = {}, {}
        for s in ("q8", "q4", "q8_old", "q4_old"):
            r = row.get(s, {})
            if "decode_tok_s" not in r or "decode_tok_s" not in bf16:
                continue
            ratios[f"{s}_over_bf16_decode_tok_s"] = round(
                r["decode_tok_s"] / bf16["decode_tok_s"], 3
            )
            ratios[f"{s}_over_bf16_prefill_s"] = round(
                r["prefill_s"] / bf16["prefill_s"], 3
            )
            ratios[f"{s}_over_bf16_prefill_peak"] = round(
                r["prefill_peak"] / bf16["prefill_peak"], 3
            )
            if not s.endswith("_old"):  # the old road ran alone
                ratios.update(_paired(s, r, bf16))
            old = row.get(f"{s}_old", {})
            if "tokens" in old:
                same = r["tokens"] == old["tokens"]
                first = next(
                    (
                        i
                        for i, (a, b) in enumerate(zip(r["tokens"], old["tokens"]))
                        if a != b
                    ),
                    None,
                )
                ratios[f"{s}_tokens_equal_old_road"] = same
                ratios[f"{s}_first_differing_token"] = first
                if first is not None and "top2_margins" in old:
                    # The old road's top-2 log-probability gap where they part.
                    ratios[f"{s}_old_road_top2_margin_there"] = old["top2_margins"][
                        first
                    ]
                    ratios["old_road_top2_margin_median"] = float(
                        np.median(old["top2_margins"])
                    )
                bound = 0.9 if int(n) < 16000 else 1.0
                # Paired where the turns paired up, else the whole runs'.
                decode = ratios.get(
                    f"{s}_over_bf16_decode_paired",
                    ratios[f"{s}_over_bf16_decode_tok_s"],
                )
                prefill = ratios.get(
                    f"{s}_over_bf16_prefill_paired", ratios[f"{s}_over_bf16_prefill_s"]
                )
                targets[s] = {
                    f"decode_ge_{bound}x_bf16": decode >= bound,
                    "prefill_le_1.1x_bf16": prefill <= 1.1,
                    "prefill_peak_lt_bf16": ratios[f"{s}_over_bf16_prefill_peak"] < 1,
                    "tokens_equal_old_road": same,
                }
        for r in row.values():
            r.pop("turns_s", None)
            r.pop("tokens", None)
            r.pop("top2_margins", None)
        out[n] = {"sides": row, "ratios": ratios, "targets": targets}
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
