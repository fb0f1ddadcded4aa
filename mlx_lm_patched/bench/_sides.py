"""Sides measured in alternating rounds (``e2e``): a side is a patch switch
and a run; each is warmed up once, then run ``rounds`` times, the sides'
order alternating. Peaks are bytes above the weights, the worst round's;
the rest is the median round's. Ratios and targets compare the results."""

import contextlib
import gc
import json

import mlx.core as mx
import numpy as np
from tqdm import tqdm

import mlx_lm_patched


def _switch(*patches):
    @contextlib.contextmanager
    def switch():
        mlx_lm_patched.revert()
        if patches != ("none",):
            mlx_lm_patched.apply(*patches)
        yield
        mlx_lm_patched.apply()

    return switch


def _fresh():
    gc.collect()
    mx.synchronize()
    mx.clear_cache()


def _peak(weights):
    return max(mx.get_peak_memory(), mx.get_active_memory()) - weights


def measure(sides, rounds, log):
    """``sides``: name -> (switch, run). Warm-up, then ``rounds`` in
    alternating order; a side that raises records its error."""
    runs = {name: [] for name in sides}
    errors = {}
    bar = tqdm(total=(rounds + 1) * len(sides), desc=log, unit="run", leave=False)
    for r in range(-1, rounds):  # round -1 warms up: kernels, graphs, pools
        for name in list(sides)[:: 1 if r % 2 else -1]:
            bar.update()
            if name in errors:
                continue
            switch, run = sides[name]
            bar.set_postfix_str(f"{name}, round {r}")
            try:
                with switch():
                    out = run()
            except Exception as e:  # upstream's quantized attention on CUDA, ...
                errors[name] = f"{type(e).__name__}: {e}"[:300]
                _fresh()
                continue
            if r >= 0:
                runs[name].append(out)
    bar.close()
    result = {}
    for name in sides:
        if name in errors:
            result[name] = {"error": errors[name]}
            continue
        outs = runs[name]
        merged = {k: _merge([o[k] for o in outs], k) for k in outs[0]}
        result[name] = {k: _plain(v) for k, v in merged.items()}
    return result


def _merge(values, key):
    """Peaks: the worst round's; the rest: the median."""
    if isinstance(values[0], list):
        if key == "tokens":
            return values[0]
        return [_merge(list(x), key) for x in zip(*values)]
    return max(values) if "peak" in key else np.median(values)


def _plain(v):
    if isinstance(v, list):
        return [_plain(x) for x in v]
    if isinstance(v, (str, bool)) or v is None:
        return v
    return int(v) if float(v).is_integer() else float(v)


def _save(result, path):
    """The JSON so far, for a run cut short."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def _ratio(a, b, key):
    if "error" in a or "error" in b or not b.get(key):
        return None
    return round(a[key] / b[key], 3)


def _le(ratio, bound):
    return ratio is not None and ratio <= bound
