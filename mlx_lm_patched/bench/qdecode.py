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
  (which also rounds keys, values and probabilities to bfloat16).
- ``attention``: one decode step's attention alone, 32 layers' caches of
  the Llama-8B shape (32 query heads over 8, head dim 128), per layer:
  kernel, old road, and ``mx.fast.scaled_dot_product_attention`` over a
  bfloat16 cache; the kernel at several ``TARGET_BLOCKS`` and query counts.
- ``e2e``: each side in its own process (``--side``): a random-weight
  Llama-8B shape (``e2e.build_model``), ``generate_step`` with each
  ``--prompts`` length, ``--chunk``-token prefill steps, ``--decode``
  greedy tokens, once to warm up and once measured (``--rounds`` processes
  a side, the median decode tokens/s). Sides: ``bf16``
  (``KVCache``), ``q8`` and ``q4`` (``--kv-bits``, the kernel), ``q8_old``
  and ``q4_old`` (``MLX_LM_PATCHED_DECODE_KERNEL=0``: the old road, run in
  the first round only).
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
- ``steps``: a decode step's caches and attention alone, 32 layers
  (``_qdecode_timing.layer_steps``).

    python -m mlx_lm_patched.bench qdecode [--out qdecode.json] [--parts check,attention,e2e]
"""

import argparse
import json
import os
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models import base
from mlx_lm.models import cache as cache_module
from mlx_lm.models.cache import make_prompt_cache

import mlx_lm_patched
from mlx_lm_patched import quantized_decode_kernel as qa
from mlx_lm_patched.quantized_decode_reference import decode_attention_reference

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
    return {"cases": rows, "all_ok": all(r["ok"] for r in rows), "worst_rel": worst}


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


def _greedy(model, prompt, args, kv_bits, cache, measured=True):
    """``generate_step`` as every side runs it: greedy, the cache quantized
    from the first token (``kv_bits``), ``--chunk``-token prefill steps,
    ``--decode`` tokens (8 to warm up)."""
    return generate_step(
        prompt,
        model,
        prompt_cache=cache,
        max_tokens=args.decode if measured else 8,
        sampler=lambda x: mx.argmax(x, axis=-1),
        kv_bits=kv_bits,
        kv_group_size=64,
        quantized_kv_start=0,
        prefill_step_size=args.chunk,
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
    """One side, in this process: each prompt once to warm up, once measured."""
    kv_bits, _ = SIDES[args.side]
    _settings(args.kt, args.blocks, args.pf)
    mx.random.seed(0)  # every side's process, the same weights
    model = build_model(args)
    _fresh()
    weights = mx.get_active_memory()
    result = {}
    for n in args.prompts:
        prompt = mx.random.randint(0, args.vocab, (n,), key=mx.random.key(n))
        for measured in (False, True):
            _fresh()
            mx.reset_peak_memory()
            tic = time.perf_counter()
            cache = make_prompt_cache(model)
            gen = _greedy(model, prompt, args, kv_bits, cache, measured)
            tokens = [next(gen)[0]]
            prefill_s = time.perf_counter() - tic
            prefill_peak = _peak(weights)
            steps, tic = [], time.perf_counter()
            for t, _ in gen:
                tokens.append(t)
                steps.append(time.perf_counter() - tic)
                tic = time.perf_counter()
            decode_s = sum(steps)
            del gen
        # One more step by hand: the host's time to build it, to launch it
        # (``mx.async_eval``'s call), then the whole. A pipelined step takes
        # about build + launch where the host bounds it.
        host, launch, step = zip(
            *(_step_times(model, tokens[-1], cache) for _ in range(10))
        )
        del cache
        result[str(n)] = {}
        if args.side.endswith("_old"):  # how close the old road's picks were
            gen = _greedy(model, prompt, args, kv_bits, make_prompt_cache(model))
            margins = []
            for _, logprobs in gen:
                top = mx.topk(logprobs, 2)
                margins.append(round(abs(top[0] - top[1]).item(), 5))
            result[str(n)]["top2_margins"] = margins
        result[str(n)] |= {
            "step_host_ms": round(1e3 * float(np.median(host)), 3),
            "step_launch_ms": round(1e3 * float(np.median(launch)), 3),
            "step_synced_ms": round(1e3 * float(np.median(step)), 3),
            "prefill_s": round(prefill_s, 4),
            "prefill_peak": prefill_peak,
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
        print(
            f"[qdecode] {args.side} {n} {result[str(n)]['decode_tok_s']} tok/s",
            file=sys.stderr,
            flush=True,
        )
    return result


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
    ``mx.async_eval``'s call) and the whole, synced (``synced``); then, us a
    call over the first layer's cache, its update (``update_us``) and the
    attention call after it (``attention_us``). Where build + launch exceeds
    the GPU's time a step, the host bounds decode."""
    model, sides, prompts = _one_process(args)
    out = {}
    for n, prompt in prompts:
        caches, tokens, res = {}, {}, {s: ([], [], []) for s in sides}
        for side in sides:
            caches[side] = make_prompt_cache(model)
            gen = _greedy(model, prompt, args, SIDES[side][0], caches[side], False)
            tokens[side] = list(gen)[-1][0]
        for step in range(args.steps + 3):  # 3 to warm up
            for side in sides:
                times = _step_times(model, tokens[side], caches[side])
                if step >= 3:
                    for series, t in zip(res[side], times):
                        series.append(t)
        x = mx.random.normal((1, args.heads, 1, args.hidden // args.heads))
        kv = mx.random.normal((1, args.kv_heads, 1, args.hidden // args.heads))
        x, kv = x.astype(mx.bfloat16), kv.astype(mx.bfloat16)
        row = {}
        for side in sides:
            c, calls = caches[side][0], args.layers
            tic = time.perf_counter()
            for _ in range(calls):
                k, v = c.update_and_fetch(kv, kv)
            updated = time.perf_counter()
            for _ in range(calls):
                o = base.scaled_dot_product_attention(x, k, v, c, 0.088, None)
            attended = time.perf_counter()
            mx.eval(o, k, v)
            med = [round(1e3 * float(np.median(x)), 3) for x in res[side]]
            row[side] = dict(zip(("build_ms", "launch_ms", "synced_ms"), med))
            row[side]["update_us"] = round(1e6 * (updated - tic) / calls, 2)
            row[side]["attention_us"] = round(1e6 * (attended - updated) / calls, 2)
        out[str(n)] = row
        print(f"[qdecode] host {n} {row}", file=sys.stderr, flush=True)
    return out


def e2e(args):
    """Each side's process ``--rounds`` times, the sides taking turns (the
    old road's once: its tokens), every other round in reverse; a side's
    decode tokens/s and prefill seconds are its medians over the rounds (a
    process's figure moved by up to a third between runs on one machine),
    the rest its first round's. With ``--out``, the finished
    rounds' summary goes to ``<out>.partial`` after each round (a run cut
    off keeps them), removed once all are done."""
    sides, partial = {}, args.out and args.out + ".partial"
    for round_ in range(args.rounds):
        if round_ and partial:
            with open(partial, "w") as f:
                json.dump({"rounds_done": round_, "e2e": _e2e_summary(args, sides)}, f)
        # Every other round in reverse: a drift of the host over the run
        # does not favour the sides that come first.
        for side in args.sides[:: -1 if round_ % 2 else 1]:
            if round_ and side.endswith("_old"):  # its tokens are needed once
                continue
            env = dict(os.environ, MLX_LM_PATCHED_DECODE_KERNEL=SIDES[side][1])
            argv = [sys.executable, "-m", __name__, "--side", side]
            argv += ["--prompts", ",".join(map(str, args.prompts))]
            argv += ["--decode", str(args.decode), "--chunk", str(args.chunk)]
            argv += ["--blocks", str(args.blocks), "--kt", str(args.kt)]
            argv += ["--pf", str(int(args.pf))]
            for k in ("layers", "hidden", "heads", "kv_heads", "intermediate"):
                argv += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
            argv += ["--vocab", str(args.vocab)]
            done = subprocess.run(argv, env=env, capture_output=True, text=True)
            sys.stderr.write(done.stderr[-3000:])
            if done.returncode:
                sides[side] = {"error": done.stderr[-500:]}
                continue
            got = json.loads(done.stdout.strip().splitlines()[-1])
            if side not in sides:
                sides[side] = got
            for n, r in got.items():
                if "decode_tok_s" in sides[side].get(n, {}):
                    first = sides[side][n]
                    for k in ("decode_tok_s", "prefill_s"):
                        first.setdefault(f"{k}_rounds", []).append(r[k])
                        first[k] = float(np.median(first[f"{k}_rounds"]))
    if partial and os.path.exists(partial):
        os.remove(partial)
    return _e2e_summary(args, sides)


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
                targets[s] = {
                    f"decode_ge_{bound}x_bf16": ratios[f"{s}_over_bf16_decode_tok_s"]
                    >= bound,
                    "prefill_le_1.1x_bf16": ratios[f"{s}_over_bf16_prefill_s"] <= 1.1,
                    "prefill_peak_lt_bf16": ratios[f"{s}_over_bf16_prefill_peak"] < 1,
                    "tokens_equal_old_road": same,
                }
        for r in row.values():
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
    p.add_argument("--rounds", type=int, default=1, help="e2e, turns: a side's runs")
    p.add_argument("--steps", type=int, default=30, help="host: steps a side")
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
