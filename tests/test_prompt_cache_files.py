"""Prompt cache files: plain mlx-lm reads what the patched package writes,
wherever upstream's format can express the cache.

One patched process writes a file per cache kind and continues each cache
greedily; a plain mlx-lm process (which never imports ``mlx_lm_patched``)
and a patched one load the files and continue them the same way.
"""

import json
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.models.cache import QuantizedKVCache, load_prompt_cache, save_prompt_cache

# Run as ``python -c SCRIPT {write,plain,patched} DIR MODELS_JSON``: prints
# {kind: tokens} for every cache kind it writes (write) or finds in DIR.
SCRIPT = r"""
import json, os, sys

mode, out, models = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
if mode != "plain":
    import mlx_lm_patched
import mlx.core as mx
from mlx_lm import load
from mlx_lm.models import cache as C

assert (mode == "plain") == ("mlx_lm_patched" not in sys.modules)

# kind: (model, one layer's cache, prompts, how to continue it); rings of 48
# slots wrap on the 100-token prompt.
KINDS = {
    "KVCache": ("d64", lambda: C.KVCache(), 1, "chunk"),
    "RotatingKVCache keep=0": ("d64", lambda: C.RotatingKVCache(48), 1, "chunk"),
    "RotatingKVCache keep=4": ("d64", lambda: C.RotatingKVCache(48, 4), 1, "decode"),
    "QuantizedKVCache head 64": ("d64", lambda: C.QuantizedKVCache(64, 8), 1, "chunk"),
    "QuantizedKVCache head 96": ("d96", lambda: C.QuantizedKVCache(64, 8), 1, "chunk"),
    "QuantizedKVCache head 80": ("d80", lambda: C.QuantizedKVCache(64, 4), 1, "chunk"),
    "BatchKVCache": ("d64", lambda: C.KVCache(), 2, "batch"),
    "BatchRotatingKVCache keep=0": ("d64", lambda: C.RotatingKVCache(48), 2, "rows"),
    # No upstream twin: patched only.
    "QuantizedRotatingKVCache": (
        "d64", lambda: C.RotatingKVCache(48, 4), 1, "quantize chunk"
    ),
    "BatchQuantizedKVCache": ("d64", lambda: C.QuantizedKVCache(64, 8), 2, "batch"),
    "BatchQuantizedRotatingKVCache": (
        "d64", lambda: C.RotatingKVCache(48, 4), 2, "quantize batch"
    ),
}
PROMPTS = [[(i * 37 + 11) % 500 for i in range(100)], [(i * 53 + 7) % 500 for i in range(70)]]
CHUNK = [3, 141, 59, 26, 5]

loaded = {}


def model(name):
    if name not in loaded:
        loaded[name] = load(models[name])[0]
    return loaded[name]


def greedy(m, cache, inputs, n=8):
    # Each step's three likeliest tokens, the first fed back (greedy).
    y, out = mx.array(inputs), []
    for _ in range(n):
        top = mx.argsort(-m(y, cache=cache)[:, -1], axis=-1)[:, :3]
        out.append(top.tolist())
        y = top[:, :1]
    return out


def build(kind):
    name, make, rows, how = KINDS[kind]
    m = model(name)
    caches = []
    for prompt in PROMPTS[:rows]:
        caches.append([make() for _ in m.layers])
        m(mx.array([prompt]), cache=caches[-1])
    if "quantize" in how:
        caches = [[c.to_quantized(64, 8) for c in cache] for cache in caches]
    if rows > 1:
        return [type(layer[0]).merge(list(layer)) for layer in zip(*caches)]
    return caches[0]


def carry_on(kind, cache):
    m, how = model(KINDS[kind][0]), KINDS[kind][3]
    if how.endswith("chunk"):
        return greedy(m, cache, [CHUNK])
    if how == "decode":
        return greedy(m, cache, [CHUNK[:1]])
    if how == "rows":  # upstream cannot update a loaded BatchRotatingKVCache
        rows = [[c.extract(i) for c in cache] for i in range(2)]
        return [greedy(m, r, [CHUNK[:1]]) for r in rows]
    return greedy(m, cache, [CHUNK[:1], CHUNK[1:2]])


tokens = {}
if mode == "write":
    for kind in KINDS:
        cache = build(kind)
        path = os.path.join(out, kind + ".safetensors")
        C.save_prompt_cache(path, cache)
        tokens[kind] = carry_on(kind, cache)
else:
    for kind in KINDS:
        try:
            cache = C.load_prompt_cache(os.path.join(out, kind + ".safetensors"))
            tokens[kind] = carry_on(kind, cache)
        except Exception as e:
            tokens[kind] = f"{type(e).__name__}: {e}"
print(json.dumps(tokens))
"""

UPSTREAM_READABLE = [
    "KVCache",
    "RotatingKVCache keep=0",
    "RotatingKVCache keep=4",
    "QuantizedKVCache head 64",
    "QuantizedKVCache head 96",
    "BatchKVCache",
    "BatchRotatingKVCache keep=0",
]
PATCHED_ONLY = [
    "QuantizedKVCache head 80",
    "QuantizedRotatingKVCache",
    "BatchQuantizedKVCache",
    "BatchQuantizedRotatingKVCache",
]


@pytest.fixture(scope="module")
def continued(make_tiny_dir, tmp_path_factory):
    """{mode: {kind: greedy tokens after the file, or the error}}."""
    out = tmp_path_factory.mktemp("cache-files")
    models = {f"d{d}": str(make_tiny_dir("llama", head_dim=d)) for d in (64, 96, 80)}
    result = {}
    for mode in ("write", "plain", "patched"):
        done = subprocess.run(
            [sys.executable, "-c", SCRIPT, mode, str(out), json.dumps(models)],
            capture_output=True,
            text=True,
        )
        assert done.returncode == 0, done.stderr
        result[mode] = json.loads(done.stdout.splitlines()[-1])
    return result


@pytest.mark.parametrize("kind", UPSTREAM_READABLE)
def test_plain_mlx_lm_continues_a_patched_file_with_the_same_tokens(continued, kind):
    assert continued["plain"][kind] == continued["write"][kind]


@pytest.mark.parametrize("kind", UPSTREAM_READABLE + PATCHED_ONLY)
def test_patched_file_loads_patched_and_continues_with_the_same_tokens(continued, kind):
    assert continued["patched"][kind] == continued["write"][kind]


@pytest.mark.parametrize("kind", PATCHED_ONLY)
def test_plain_mlx_lm_refuses_at_load_what_its_format_cannot_express(continued, kind):
    """Zero-padded head dims (80 at 4 bits) and classes upstream lacks fail
    in plain ``load_prompt_cache``, not later with wrong tokens."""
    assert isinstance(continued["plain"][kind], str), continued["plain"][kind]
    assert continued["plain"][kind].startswith(("ValueError", "KeyError"))


def test_quantized_file_keeps_upstreams_five_items_unless_head_dims_are_padded(
    tmp_path,
):
    for dim, items in ((64, 5), (96, 5), (80, 7)):
        cache = QuantizedKVCache(64, 4)
        cache.update_and_fetch(*(mx.random.normal((1, 2, 9, dim)) for _ in "kv"))
        assert len(cache.state) == items, dim
        path = str(tmp_path / f"{dim}.safetensors")
        save_prompt_cache(path, [cache])
        (loaded,) = load_prompt_cache(path)
        assert (loaded.head_dims, loaded.dtype) == ((dim, dim), "float32")


def test_quantized_file_written_with_the_old_seven_item_state_still_loads(tmp_path):
    """Files written before upstream's layout was kept: dtype and head dims
    as two more items, even where they follow from the arrays."""
    cache = QuantizedKVCache(64, 8)
    cache.update_and_fetch(*(mx.random.normal((1, 2, 9, 64)) for _ in "kv"))
    old = (*cache.state[:5], "float32", (64, 64))
    writer = type("QuantizedKVCache", (), {"state": old})()
    path = str(tmp_path / "old.safetensors")
    save_prompt_cache(path, [writer])
    (loaded,) = load_prompt_cache(path)
    assert (loaded.offset, loaded.dtype, loaded.head_dims) == (9, "float32", (64, 64))
    keys = cache.keys_and_values()[0]
    assert all(mx.array_equal(a, b).item() for a, b in zip(loaded.keys, keys))
    loaded.update_and_fetch(*(mx.random.normal((1, 2, 1, 64)) for _ in "kv"))
    assert loaded.size() == 10
