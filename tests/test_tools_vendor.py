"""The vendored wheel (``python -m tools vendor``) against the monkeypatch,
and what ``pip install`` of this project ships."""

import inspect
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

import mlx_lm_patched
from tools import PATCH_DIR, ROOT
from tools.series import patch_name, read_series
from tools.vendor import build_wheel, vendor_version


def _scenario(out_path: str, model_path: str, vendored_root, patches):
    """Fixed sequences of cache updates and a short generation, every output
    saved to ``out_path`` (.npz). Runs in a fresh interpreter, on the wheel
    installed at ``vendored_root`` or with ``patches`` applied (strictly)."""
    import os
    import sys
    import tempfile

    import mlx.core as mx
    import mlx_lm
    import numpy as np

    if vendored_root:
        assert mlx_lm.__file__.startswith(vendored_root), mlx_lm.__file__
        assert "+patched." in mlx_lm.__version__, mlx_lm.__version__
        assert "mlx_lm_patched" not in sys.modules
    else:
        import mlx_lm_patched

        applied = mlx_lm_patched.apply(*patches, strict=True) if patches else []
        assert applied == patches, applied

    from mlx_lm.generate import generate_step
    from mlx_lm.models import cache as C
    from mlx_lm.utils import load

    out = {}

    def rec(name, x):
        if isinstance(x, (tuple, list)):
            out[f"{name}:len"] = np.array(len(x))
            for i, y in enumerate(x):
                rec(f"{name}.{i}", y)
        elif x is None or isinstance(x, str):
            out[f"{name}:{x}"] = np.zeros(0)
        elif isinstance(x, mx.array):
            out[name] = np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x)
        else:
            out[name] = np.array(x)

    def outcome(name, f):
        try:
            rec(name, f())
        except Exception as e:  # the same error either way counts as the same
            rec(f"{name}:raised", type(e).__name__)

    caches = {
        "kv": (C.KVCache, {}),
        "rot8": (C.RotatingKVCache, {"max_size": 8}),
        "rot8keep2": (C.RotatingKVCache, {"max_size": 8, "keep": 2}),
        "rot300": (C.RotatingKVCache, {"max_size": 300}),
        "quant": (C.QuantizedKVCache, {"group_size": 32, "bits": 4}),
    }
    chunks = [5, 1, 1, 7, 1, 1, 1, 12, 1, 3, 1, 260, 1, 2]
    mx.random.seed(0)
    data = [mx.random.normal((1, 2, 2 * s, 32)) for s in chunks]
    d = tempfile.mkdtemp()
    for name, (cls, kw) in caches.items():
        c = cls(**kw)
        for i, x in enumerate(data):
            k, v = x[:, :, : chunks[i]], x[:, :, chunks[i] :]
            if hasattr(c, "make_mask") and cls is not C.QuantizedKVCache:
                outcome(f"{name}.{i}.mask", lambda: c.make_mask(k.shape[2]))
                if cls is C.RotatingKVCache:
                    outcome(
                        f"{name}.{i}.mask6",
                        lambda: c.make_mask(k.shape[2], window_size=6),
                    )
            outcome(f"{name}.{i}.fetch", lambda: c.update_and_fetch(k, v))
            rec(f"{name}.{i}.offset", c.offset)
            if i == 3:
                outcome(
                    f"{name}.{i}.trim", lambda: c.trim(2) if c.is_trimmable() else -1
                )
        outcome(f"{name}.state", lambda: c.state)
        outcome(f"{name}.meta", lambda: c.meta_state)
        path = os.path.join(d, f"{name}.safetensors")
        C.save_prompt_cache(path, [c])
        (loaded,) = C.load_prompt_cache(path)
        k, v = data[1][:, :, :1], data[1][:, :, 1:]
        outcome(f"{name}.loaded.fetch", lambda: loaded.update_and_fetch(k, v))

    batch = C.BatchRotatingKVCache(max_size=8, left_padding=[3, 0])
    mx.random.seed(1)
    for i, s in enumerate([6, 1, 1, 5, 1, 1, 1, 1, 1]):
        k, v = mx.random.normal((2, 2, s, 16)), mx.random.normal((2, 2, s, 16))
        outcome(f"batchrot.{i}.mask", lambda: batch.make_mask(s, return_array=True))
        outcome(f"batchrot.{i}.fetch", lambda: batch.update_and_fetch(k, v))

    for op, f in (
        ("filter", lambda: batch.filter(mx.array([1]))),
        ("extend", lambda: batch.extend(C.BatchRotatingKVCache(8, [1]))),
        ("fetch", lambda: batch.update_and_fetch(k[:2], v[:2])),
        ("extract", lambda: batch.extract(0).state),
        ("state", lambda: batch.state),
    ):
        outcome(f"batchrot.{op}", f)
    singles = []
    for n in (3, 9, 14):
        c = C.RotatingKVCache(max_size=8)
        c.update_and_fetch(*[mx.random.normal((1, 2, n, 16))] * 2)
        singles.append(c)
    outcome("batchrot.merged", lambda: C.BatchRotatingKVCache.merge(singles).state)

    model, tokenizer = load(model_path)
    prompt = mx.array(tokenizer.encode("The cache keeps what a transformer read. " * 6))
    for max_kv in (None, 16, 64):
        tokens, logprobs = [], []
        for tok, lp in generate_step(
            prompt, model, max_tokens=24, max_kv_size=max_kv, prefill_step_size=16
        ):
            tokens.append(tok)
            logprobs.append(lp)
        rec(f"gen.{max_kv}.tokens", tokens)
        rec(f"gen.{max_kv}.logprobs", mx.stack(logprobs))
    np.savez(out_path, **out)


def _run_scenario(tmp_path, label, model_path, pythonpath, vendored_root, patches):
    script = tmp_path / f"scenario_{label}.py"
    script.write_text(
        textwrap.dedent(inspect.getsource(_scenario))
        + f"\n_scenario({str(tmp_path / label)!r}, {model_path!r}, "
        + f"{vendored_root!r}, {patches!r})\n"
    )
    env = {**os.environ, "PYTHONPATH": pythonpath, "MLX_LM_PATCHED_APPLY": "0"}
    r = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 0, f"{label}:\n{r.stdout}\n{r.stderr}"
    import numpy as np

    return dict(np.load(tmp_path / f"{label}.npz"))


def _differing(a: dict, b: dict) -> list:
    return sorted(
        k
        for k in set(a) | set(b)
        if k not in a
        or k not in b
        or a[k].shape != b[k].shape
        or not (a[k] == b[k]).all()
    )


def compare_vendored(tmp_path: Path, patch_dir: Path, patches: list):
    """Build the wheel from ``patch_dir``, run the scenario on it and on the
    installed mlx-lm with ``patches`` applied, and with none; return the keys
    that differ (vendored vs patched, patched vs upstream)."""
    from mlx_lm_patched.demo import tiny

    try:
        wheel, _ = build_wheel(tmp_path / "dist", patch_dir)
    except RuntimeError as e:
        if "No matching distribution" in str(e) or "connection" in str(e).lower():
            pytest.skip(f"package index unreachable, no build backend: {e}")
        raise
    assert wheel.name == f"mlx_lm-{vendor_version(patch_dir)}-py3-none-any.whl"
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
        + ["--disable-pip-version-check", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    model = str(tiny.make_model_dir(tmp_path / "model", "llama_sliding"))
    root = str(ROOT)
    vendored = _run_scenario(tmp_path, "vendored", model, str(site), str(site), [])
    patched = _run_scenario(tmp_path, "patched", model, root, None, patches)
    plain = _run_scenario(tmp_path, "upstream", model, root, None, [])
    assert len(vendored) > 200 and any(".tokens" in k for k in vendored)
    return _differing(vendored, patched), _differing(patched, plain)


@pytest.mark.slow
def test_vendored_wheel_matches_monkeypatched_package(sdist, tmp_path):
    names = [p.name for p in mlx_lm_patched.PATCHES]
    assert read_series() == [
        patch_name(i, p) for i, p in enumerate(mlx_lm_patched.PATCHES)
    ], "patches/ is stale: run `make patches`"
    vendored_vs_patched, patched_vs_upstream = compare_vendored(
        tmp_path, PATCH_DIR, names
    )
    assert vendored_vs_patched == []
    # ...and the scenario does see the patches.
    assert patched_vs_upstream != []


@pytest.mark.slow
def test_project_wheel_ships_only_the_runtime_package(tmp_path):
    """tools/ (release tooling) and tests/ stay out of ``pip install``."""
    # Built from a copy: setuptools builds in the source tree.
    skip = (".*", "build", "dist", "*.egg-info", "__pycache__")
    src = shutil.copytree(ROOT, tmp_path / "src", ignore=shutil.ignore_patterns(*skip))
    assert (src / "tools" / "__main__.py").exists()
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q"]
    r = subprocess.run(
        cmd + ["--disable-pip-version-check", "-w", str(tmp_path), str(src)],
        capture_output=True,
        text=True,
    )
    if r.returncode and "No matching distribution" in r.stderr:
        pytest.skip(f"package index unreachable, no build backend: {r.stderr}")
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("mlx_lm_patched-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    assert top == {"mlx_lm_patched", wheel.name.split("-py3")[0] + ".dist-info"}
    assert "mlx_lm_patched/_registry.py" in names
    # the files of the modules patches add to mlx-lm
    assert "mlx_lm_patched/mlx_lm/models/prompt_cache_disk.py" in names
    assert "mlx_lm_patched/mlx_lm/kernels/quantized_decode.py" in names
    assert "mlx_lm_patched/mlx_lm/server_prompt_cache.py" in names
    assert not [n for n in names if "upstream" in n or "tools" in n]
