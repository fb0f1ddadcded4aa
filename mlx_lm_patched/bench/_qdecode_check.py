"""``qdecode``'s ``check`` part: the CUDA decode kernel against fused
attention over dequantized keys and against the float32 reference, over
head dims, group sizes, bits, GQA ratios, query counts and masks; then a
``QuantizedKVCache``'s decode steps past a flush of its tail."""

import sys

import mlx.core as mx
import numpy as np
from mlx_lm.kernels import quantized_decode as qa
from mlx_lm.models import base
from mlx_lm.models import cache as cache_module

from mlx_lm_patched.kernels.quantized_decode_reference import decode_attention_reference

from ._qdecode_timing import _cache, _rel, old_road


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
            B, n_kv, q_keys[0].shape[2], -(-n_rep * L // qa.DECODE_ROWS)
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
