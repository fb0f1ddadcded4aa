"""Cache-only memory benchmark: upstream vs patched rotating KV caches.

Runs each scenario twice in one process, upstream (``mlx_lm_patched.revert()``)
then patched (``mlx_lm_patched.apply()``), on the KV geometry of Qwen3-8B
(36 layers x 8 KV heads x head_dim 128, bfloat16) with no model: random keys
and values are fed to one cache per layer and each step evaluates what the
caches return, and after a multi-token step their state, as
``mlx_lm.generate`` does.

Scenarios:
  a  prefill ``--prefill`` tokens, then ``--decode`` single-token steps
  b  prefill ``--long-prefill`` tokens in ``--chunk``-token chunks, decode,
     then a ``--turn``-token second turn on the full ring
  c  ``BatchRotatingKVCache`` with ``--batch`` left-padded rows, prefill, decode

Each side runs ``--rounds`` times in alternating order (upstream, patched,
patched, upstream, ...) after an unrecorded ``--warmup`` run that compiles
kernels; step times are pooled over the rounds, counts and bytes are the
worst round's.

Memory figures are bytes above the active memory at the scenario's start, net
of the random inputs the harness holds during the step. A reallocation is a
step after which a layer's ``cache.keys`` has another shape, or a decode step
after which it has another buffer (``--realloc-method pointer``, the default
on the CPU), or, where reading the pointer would move the buffer (CUDA), a
shape change or a decode step whose transient reaches one layer's keys +
values (``memory``). A chunk past a ring leaves a ring of the same shape in
another buffer (writing into the old one would need a sync in the model).
"""

import argparse
import gc
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchRotatingKVCache, RotatingKVCache
from tqdm import tqdm

import mlx_lm_patched

from . import emit, header, parse_args

SCENARIOS = {
    "a": "RotatingKVCache: prefill, then decode",
    "b": "RotatingKVCache: chunked long prefill, decode, second turn on a full ring",
    "c": "BatchRotatingKVCache: left-padded batch prefill, then decode",
}
_UINT = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def pointer(a: mx.array) -> int:
    """Address of ``a``'s first element, read without copying the data."""
    v = a.view(_UINT[a.itemsize])  # bfloat16 has no buffer-protocol format
    mx.eval(v)
    return np.asarray(memoryview(v)).ctypes.data


def _state_arrays(c):
    return [x for x in c.state if isinstance(x, mx.array)]


def _inputs(layers, batch, heads, S, head_dim, dtype):
    """Fresh random keys and values for one step, a distinct buffer each."""
    big = mx.random.normal((2 * layers, batch, heads, S, head_dim), dtype=dtype)
    kv = [(big[2 * i] * 1, big[2 * i + 1] * 1) for i in range(layers)]
    mx.eval(kv)
    return kv


def _step(caches, kv, layerwise):
    # generate_step evaluates the caches' state after a prefill chunk, not
    # after a decode step (its attention consumes what the caches return).
    state = _state_arrays if kv[0][0].shape[2] > 1 else lambda c: []
    if layerwise:
        # Only one layer's returned arrays alive at a time, as in a model
        # whose attention consumes them before the next layer runs.
        for c, (k, v) in zip(caches, kv):
            mx.eval(c.update_and_fetch(k, v), state(c))
    else:
        out = [c.update_and_fetch(k, v) for c, (k, v) in zip(caches, kv)]
        mx.eval(out, [state(c) for c in caches])


class _Buffers:
    """Counts reallocations of each layer's ``cache.keys``."""

    def __init__(self, caches, method):
        self.caches, self.method = caches, method
        self.seen = [None] * len(caches)

    def _id(self, c):
        if c.keys is None:
            return None
        ptr = pointer(c.keys) if self.method == "pointer" else None
        return tuple(c.keys.shape), ptr

    def update(self, S, transient):
        changed = 0
        for i, c in enumerate(self.caches):
            now, before = self._id(c), self.seen[i]
            if before is not None and now != before:
                # A chunk past a ring leaves a new ring of the same shape.
                changed += S == 1 or now is None or now[0] != before[0]
            self.seen[i] = now
        if self.method == "memory" and S == 1:
            layer = self.caches[0].keys.nbytes + self.caches[0].values.nbytes
            changed = max(changed, min(len(self.caches), transient // layer))
        return int(changed)


def _plan(args, scenario, decode=None):
    """[(phase, tokens per step, steps)]"""
    decode = args.decode if decode is None else decode

    def chunks(n):
        return [("prefill", min(args.chunk, n - i), 1) for i in range(0, n, args.chunk)]

    prefill = args.long_prefill if scenario == "b" else args.prefill
    plan = chunks(prefill) + [("decode", 1, decode)]
    if scenario == "b" and args.turn:
        plan.append(("turn", args.turn, 1))
    return plan


def _paddings(args):
    pads = [0, 3, 7, 12] + [4 * i for i in range(4, args.batch)]
    return [min(p, args.prefill - 1) for p in pads[: args.batch]]


def _make(args, scenario):
    if scenario == "c":
        pads = _paddings(args)
        return [BatchRotatingKVCache(args.max_size, pads) for _ in range(args.layers)]
    return [RotatingKVCache(args.max_size, keep=args.keep) for _ in range(args.layers)]


def _ms(ms):
    return {
        "median": float(np.median(ms)),
        "p99": float(np.percentile(ms, 99)),
        "max": float(ms.max()),
    }


def run_side(args, scenario, plan, token_bytes, layerwise=False):
    """One side of one scenario; returns (figures, per-step trace)."""
    gc.collect()
    mx.clear_cache()
    batch = args.batch if scenario == "c" else 1
    base = mx.get_active_memory()
    caches = _make(args, scenario)
    buffers = _Buffers(caches, args.realloc_method)
    trace = {"phase": [], "ms": [], "transient": [], "peak": [], "active": []}
    reallocs = {"prefill": 0, "decode": 0, "turn": 0}
    for phase, S, n in plan:
        for _ in range(n):
            kv = _inputs(args.layers, batch, args.heads, S, args.head_dim, args.dtype)
            held = sum(k.nbytes + v.nbytes for k, v in kv)
            before = mx.get_active_memory()
            mx.reset_peak_memory()
            tic = time.perf_counter()
            _step(caches, kv, layerwise)
            ms = 1e3 * (time.perf_counter() - tic)
            peak = max(mx.get_peak_memory(), before)
            del kv
            transient = peak - before
            reallocs[phase] += buffers.update(S, transient)
            trace["phase"].append(phase)
            trace["ms"].append(ms)
            trace["transient"].append(transient)
            trace["peak"].append(peak - base - held)
            trace["active"].append(mx.get_active_memory() - base)
    phase = np.array(trace["phase"])
    ms, transient, peak = (np.array(trace[k]) for k in ("ms", "transient", "peak"))
    dec, pre = phase == "decode", phase == "prefill"
    tok = token_bytes * batch
    out = {
        "reallocations": sum(reallocs.values()),
        "reallocations_by_phase": reallocs,
        "worst_transient": int(transient.max()),
        "worst_decode_transient": int(transient[dec].max()) if dec.any() else 0,
        "worst_decode_step": int(transient[dec].argmax()) if dec.any() else -1,
        "decode_steps_over_one_token": int((transient[dec] > tok).sum()),
        "peak": int(peak.max()),
        "prefill_peak": int(peak[pre].max()),
        "active_end": trace["active"][-1],
        "cache_nbytes_end": sum(c.nbytes for c in caches),
        "allocator_cache_end": mx.get_cache_memory(),
        "prefill_ms": [round(x, 3) for x in ms[pre]],
    }
    if dec.any():
        out["step_ms"] = _ms(ms[dec])
    if (phase == "turn").any():
        turn = phase == "turn"
        out["turn"] = {
            "transient": int(transient[turn].max()),
            "peak": int(peak[turn].max()),
            "ms": float(ms[turn].max()),
            "reallocations": reallocs["turn"],
        }
    del caches, buffers
    gc.collect()
    mx.clear_cache()
    return out, trace


def _merge(figs):
    """Worst over rounds for counts and bytes, mean for prefill times."""
    first = figs[0]
    if isinstance(first, dict):
        return {k: _merge([f[k] for f in figs]) for k in first}
    if isinstance(first, list):
        return [round(float(np.mean(x)), 3) for x in zip(*figs)]
    return max(figs)


def run_scenario(args, scenario, token_bytes):
    batch = args.batch if scenario == "c" else 1
    plan = _plan(args, scenario)
    res = {"description": SCENARIOS[scenario], "plan": [list(p) for p in plan]}
    if scenario == "c":
        res["left_padding"] = _paddings(args)
    sides = {"upstream": mlx_lm_patched.revert, "patched": mlx_lm_patched.apply}
    if args.warmup:
        for name, switch in sides.items():
            switch()
            warm = _plan(args, scenario, decode=args.warmup)
            run_side(args, scenario, warm, token_bytes)
    figs = {name: [] for name in sides}
    traces = {}
    bar = tqdm(total=args.rounds * len(sides), desc=f"scenario {scenario}", leave=False)
    for r in range(args.rounds):
        # Alternate the order (upstream, patched, patched, upstream, ...) so
        # drift over the run does not favour either side.
        for name in list(sides)[:: 1 if r % 2 == 0 else -1]:
            sides[name]()
            bar.set_postfix_str(f"{name}, round {r}")
            fig, trace = run_side(args, scenario, plan, token_bytes)
            figs[name].append(fig)
            traces.setdefault(name, trace)
            dec = np.array(trace["phase"]) == "decode"
            fig["decode_ms"] = np.array(trace["ms"])[dec]
            bar.update()
    bar.close()
    for name in sides:
        pooled = np.concatenate([f.pop("decode_ms") for f in figs[name]])
        res[name] = _merge(figs[name])
        res[name]["step_ms"] = _ms(pooled)
        res[name]["step_ms_median_by_round"] = [
            f["step_ms"]["median"] for f in figs[name]
        ]
        res[name]["reallocations_by_round"] = [f["reallocations"] for f in figs[name]]
        res[name]["reallocations_per_layer"] = res[name]["reallocations"] / args.layers
        if scenario == "b":
            # Prefill and second turn again, one layer's returned arrays alive
            # at a time (the liveness inside a model's forward pass).
            sides[name]()
            lw = [p for p in plan if p[0] != "decode"]
            lw_res, _ = run_side(args, scenario, lw, token_bytes, layerwise=True)
            res[name]["layerwise"] = {
                k: lw_res[k] for k in ("prefill_peak", "worst_transient", "turn")
            }
    mlx_lm_patched.apply()
    p, u = res["patched"], res["upstream"]
    tok = token_bytes * batch
    bound = 1.05 * (args.max_size + args.chunk - 1) * tok
    res["token_kv_bytes"] = tok
    res["prefill_peak_bound"] = int(bound)
    res["targets"] = {
        "zero_reallocations": p["reallocations"] == 0,
        "zero_decode_reallocations": p["reallocations_by_phase"]["decode"] == 0,
        "decode_transient_le_one_token": p["worst_decode_transient"] <= tok,
        "prefill_peak_le_bound": p["prefill_peak"] <= bound,
        "median_le_upstream": p["step_ms"]["median"] <= u["step_ms"]["median"],
        "worst_le_3x_median": p["step_ms"]["max"] <= 3 * p["step_ms"]["median"],
    }
    if "layerwise" in p:
        lw = p["layerwise"]["prefill_peak"] <= bound
        res["targets"]["layerwise_prefill_peak_le_bound"] = lw
    return res, traces


def plot(traces, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 1, figsize=(10, 3.2 * len(traces)))
    axes = np.atleast_1d(axes)
    for ax, (scenario, sides) in zip(axes, traces.items()):
        for (name, t), color in zip(sides.items(), ("tab:red", "tab:blue")):
            mib = np.array(t["active"]) / 2**20
            peak = np.array(t["peak"]) / 2**20
            ax.plot(peak, color=color, lw=0.6, alpha=0.5, label=f"{name} peak in step")
            ax.plot(mib, color=color, lw=1.5, label=f"{name} active")
        ax.set_title(f"{scenario}: {SCENARIOS[scenario]}", fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("MiB above start")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_lm_patched.bench memory",
        description="Rotating KV cache memory: upstream vs patched, one run.",
    )
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--max-size", type=int, default=4096)
    p.add_argument("--keep", type=int, default=4)
    p.add_argument("--prefill", type=int, default=512)
    p.add_argument("--long-prefill", type=int, default=6000)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--turn", type=int, default=512)
    p.add_argument("--decode", type=int, default=5000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--scenarios", default="abc", help="any of a, b, c")
    p.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="measured runs per side, in alternating order; times are pooled, "
        "counts and bytes are the worst round's",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=32,
        help="decode steps of an unrecorded run per side first (0: none)",
    )
    p.add_argument("--device", choices=["cpu", "gpu"], help="default: MLX's")
    p.add_argument(
        "--realloc-method",
        choices=["auto", "pointer", "memory"],
        default="auto",
        help="auto: pointer on the CPU, memory elsewhere",
    )
    p.add_argument("--png", help="plot active memory over steps to this file")
    p.add_argument("--out", help="also write the JSON to this file")
    return p


def main(argv=None):
    args = parse_args(build_parser(), argv)
    device = mx.default_device()
    if args.realloc_method == "auto":
        args.realloc_method = "pointer" if device == mx.cpu else "memory"
    args.dtype = getattr(mx, args.dtype)
    token_bytes = 2 * args.layers * args.heads * args.head_dim * args.dtype.size
    patches = [p.name for p in mlx_lm_patched.PATCHES]
    result = {
        **header("memory", patches),
        "rotating_prealloc": "rotating_prealloc" in patches,
        "geometry": {
            k: getattr(args, k)
            for k in ("layers", "heads", "head_dim", "max_size", "keep", "batch")
        },
        "dtype": str(args.dtype),
        "realloc_method": args.realloc_method,
        "token_kv_bytes": token_bytes,
        "scenarios": {},
    }
    traces = {}
    for s in args.scenarios:
        result["scenarios"][s], traces[s] = run_scenario(args, s, token_bytes)
    result["all_targets_met"] = all(
        all(r["targets"].values()) for r in result["scenarios"].values()
    )
    emit(result, args.out)
    if args.png:
        plot(traces, args.png)
    return result


if __name__ == "__main__":
    main()
