"""Bad inputs: each raises an exception that names what is wrong, and leaves
the cache, the file or the installed mlx-lm as it was.

A row the current code fails is written as it should pass and marked
``xfail(strict=True)`` with the reason.
"""

import os
import re
import subprocess
import sys

import mlx.core as mx
import mlx_lm.models.cache as cache_module
import numpy as np
import pytest
from mlx_lm.models.cache import (
    BatchKVCache,
    BatchRotatingKVCache,
    ChunkedKVCache,
    ConcatenateKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    load_prompt_cache,
    save_prompt_cache,
)
from ringref import attend, random_kv, reference_mask

import mlx_lm_patched

pytestmark = pytest.mark.usefixtures("patched")


def frozen(cache):
    """Everything a cache holds, as plain comparable values."""

    def value(x):
        if isinstance(x, mx.array):
            return (str(x.dtype), x.shape, np.array(x.astype(mx.float32)).tobytes())
        if isinstance(x, (list, tuple)):
            return tuple(value(y) for y in x)
        return x

    return {k: value(v) for k, v in vars(cache).items()}


def ring(n=5, max_size=8, keep=2, B=1):
    cache = RotatingKVCache(max_size, keep)
    cache.update_and_fetch(*random_kv(B, 2, n, 4))
    return cache


def batch(n=3, max_size=8, keep=0):
    cache = BatchRotatingKVCache(max_size, [0, 1], keep)
    cache.update_and_fetch(*random_kv(2, 2, n, 4))
    return cache


def quantized(n=5, group_size=64, bits=8):
    cache = QuantizedKVCache(group_size, bits)
    cache.update_and_fetch(*random_kv(1, 2, n, 64))
    return cache


def save_load(cache, tmp_path):
    save_prompt_cache(str(tmp_path / "c.safetensors"), [cache])
    return load_prompt_cache(str(tmp_path / "c.safetensors"))[0]


def raises_unchanged(cache, call, error, match):
    before = frozen(cache)
    with pytest.raises(error, match=match):
        call()
    assert frozen(cache) == before


# Trims


def every_cache_kind():
    """{class name: a filled cache} for every cache kind that trims."""
    single = [KVCache(), ConcatenateKVCache(), ChunkedKVCache(16)]
    batched = [BatchKVCache([0, 1]), BatchKVCache([0, 1]).to_quantized(64, 8)]
    for c in single:
        c.update_and_fetch(*random_kv(1, 2, 5, 64))
    for c in batched:
        c.update_and_fetch(*random_kv(2, 2, 5, 64))
    caches = [ring(), batch(), quantized()] + single + batched
    caches += [ring().to_quantized(64, 8), batch().to_quantized(64, 8)]
    return {type(c).__name__: c for c in caches}


TRIMMING = [
    "RotatingKVCache",
    "BatchRotatingKVCache",
    "QuantizedKVCache",
    "KVCache",
    "ConcatenateKVCache",
    "ChunkedKVCache",
    "BatchKVCache",
    "BatchQuantizedKVCache",
    "QuantizedRotatingKVCache",
    "BatchQuantizedRotatingKVCache",
]


@pytest.mark.parametrize("kind", TRIMMING)
def test_negative_trim_of_every_cache_kind_raises_in_one_format(kind):
    cache = every_cache_kind()[kind]
    message = f"^{kind}.trim: n must be >= 0, got -1$"
    raises_unchanged(cache, lambda: cache.trim(-1), ValueError, message)


@pytest.mark.parametrize("n", [2.5, float("nan"), float("inf"), "3"])
@pytest.mark.parametrize("kind", TRIMMING)
def test_non_integer_trim_of_every_cache_kind_raises_naming_the_count(kind, n):
    """Upstream: 2.5 leaves a float offset (the next model call fails in
    rope), nan and inf take every token off."""
    cache = every_cache_kind()[kind]
    message = f"^{kind}.trim: n must be an integer, got {re.escape(repr(n))}$"
    raises_unchanged(cache, lambda: cache.trim(n), ValueError, message)


@pytest.mark.parametrize("n", [2.5, float("nan"), float("inf")])
@pytest.mark.parametrize("kind", ["KVCache", "RotatingKVCache", "QuantizedKVCache"])
def test_trim_prompt_cache_of_a_non_integer_count_raises_naming_it(kind, n):
    cache = every_cache_kind()[kind]
    message = f"trim_prompt_cache: num_tokens must be an integer, got {n!r}"
    raises_unchanged(
        cache,
        lambda: cache_module.trim_prompt_cache([cache], n),
        ValueError,
        re.escape(message),
    )


@pytest.mark.parametrize("make", [ring, batch])
def test_trim_of_a_wrapped_ring_raises_saying_it_wrapped(make):
    cache = make(n=20)
    raises_unchanged(cache, lambda: cache.trim(1), ValueError, "wrapped")


@pytest.mark.parametrize("make", [ring, batch, quantized])
def test_oversized_trim_of_an_unwrapped_cache_trims_all_and_says_how_many(make):
    """Not an error: ``trim`` returns the count trimmed, which
    ``trim_prompt_cache`` callers rely on (upstream's contract)."""
    cache = make(n=5)
    assert cache.trim(100) == 5
    assert np.all(np.array(cache.offset) == 0)


def test_negative_reserve_raises_naming_the_count():
    cache = quantized()
    raises_unchanged(cache, lambda: cache.reserve(-4), ValueError, "-4")


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"max_size": -1}, "max_size"),
        ({"max_size": 2.0}, "max_size"),
        ({"max_bytes": -5}, "max_bytes"),
        ({"max_bytes": 1.5}, "max_bytes"),
        ({"bits": 8.0}, "bits"),
        ({"bits": 3}, "bits"),
        ({"bits": 8, "group_size": 48}, "group_size"),
    ],
)
def test_prompt_cache_of_a_bad_size_or_bits_is_refused_at_construction(kwargs, name):
    """Upstream keeps nothing with a negative or fractional size, and fails
    at the first insert (a ``quantize()`` TypeError) with ``bits=8.0``."""
    with pytest.raises(ValueError, match=f"LRUPromptCache: {name} must be"):
        cache_module.LRUPromptCache(**kwargs)


def test_prompt_cache_refuses_a_cache_holding_other_than_its_tokens():
    """Upstream stores a 100-token cache under 50 tokens, and a later fetch
    serves it as that 50-token prefix."""
    store = cache_module.LRUPromptCache()
    cache = KVCache()
    cache.update_and_fetch(*random_kv(1, 2, 100, 64))
    with pytest.raises(ValueError, match="KVCache holding 100 tokens given for 50"):
        store.insert_cache("m", list(range(50)), [cache])
    assert len(store) == 0
    assert store.fetch_nearest_cache("m", list(range(50)) + [7])[0] is None
    store.insert_cache("m", list(range(100)), [cache])
    assert len(store) == 1


# Updates that do not fit the cache


def mismatches(B, D):
    """(name, keys, values) that do not fit a cache of batch B, 2 heads, dim D."""
    k, v = random_kv(B, 2, 3, D)
    return {
        "batch": random_kv(B + 1, 2, 3, D),
        "heads": random_kv(B, 3, 3, D),
        "head_dim": random_kv(B, 2, 3, 2 * D),
        "value_dim": (k, random_kv(B, 2, 3, 2 * D)[1]),
        "dtype": (k.astype(mx.float16), v.astype(mx.float16)),
        "length": (k, v[..., :2, :]),
    }


MISMATCHES = ["batch", "heads", "head_dim", "value_dim", "dtype", "length"]


@pytest.mark.parametrize("what", MISMATCHES)
@pytest.mark.parametrize("S", [1, 3])
def test_ring_update_that_does_not_fit_raises_and_changes_nothing(what, S):
    cache = ring()
    k, v = mismatches(1, 4)[what]
    call = lambda: cache.update_and_fetch(k[..., :S, :], v[..., :S, :])
    if what == "length" and S == 1:
        call = lambda: cache.update_and_fetch(k[..., :2, :], v[..., :1, :])
    raises_unchanged(cache, call, ValueError, "RotatingKVCache holds")


@pytest.mark.parametrize("what", ["batch", "heads", "dtype"])
def test_loaded_ring_update_that_does_not_fit_raises_and_changes_nothing(
    what, tmp_path
):
    cache = save_load(ring(), tmp_path)
    k, v = mismatches(1, 4)[what]
    raises_unchanged(
        cache, lambda: cache.update_and_fetch(k, v), ValueError, "RotatingKVCache holds"
    )


@pytest.mark.parametrize("what", MISMATCHES)
def test_batch_update_that_does_not_fit_raises_and_changes_nothing(what):
    cache = batch()
    k, v = mismatches(2, 4)[what]
    raises_unchanged(
        cache,
        lambda: cache.update_and_fetch(k, v),
        ValueError,
        "BatchRotatingKVCache holds",
    )


@pytest.mark.parametrize("what", ["batch", "heads", "dtype"])
def test_loaded_batch_update_that_does_not_fit_raises_and_changes_nothing(
    what, tmp_path
):
    cache = save_load(batch(), tmp_path)
    k, v = mismatches(2, 4)[what]
    if what == "batch":
        k, v = k[:1], v[:1]
    raises_unchanged(
        cache,
        lambda: cache.update_and_fetch(k, v),
        ValueError,
        "BatchRotatingKVCache holds",
    )


@pytest.mark.parametrize("what", MISMATCHES)
def test_quantized_update_that_does_not_fit_raises_and_changes_nothing(what):
    cache = quantized()
    k, v = mismatches(1, 64)[what]
    raises_unchanged(
        cache, lambda: cache.update_and_fetch(k, v), ValueError, "QuantizedKVCache"
    )


def test_quantized_layout_no_group_size_fits_raises_before_any_change():
    cache = QuantizedKVCache(group_size=48, bits=8)
    raises_unchanged(
        cache,
        lambda: cache.update_and_fetch(*random_kv(1, 2, 3, 64)),
        ValueError,
        "group_size=48",
    )


# Batch indices out of range


@pytest.mark.parametrize("idx", [2, 5, -3])
def test_extract_of_a_row_out_of_range_raises_naming_the_row(idx):
    cache = batch()
    raises_unchanged(cache, lambda: cache.extract(idx), IndexError, f"{idx}")


@pytest.mark.parametrize("rows", [[5], [0, 2], [-3]])
def test_filter_with_a_row_out_of_range_raises_and_changes_nothing(rows):
    cache = batch()
    raises_unchanged(
        cache, lambda: cache.filter(mx.array(rows)), IndexError, "out of range"
    )


# Merges and extends of caches that do not go together


def test_merge_of_rings_of_different_max_size_raises_naming_both():
    a, b = ring(max_size=8), ring(max_size=16)
    before = frozen(a), frozen(b)
    with pytest.raises(ValueError, match=r"\(8, 2\).*\(16, 2\)"):
        BatchRotatingKVCache.merge([a, b])
    assert (frozen(a), frozen(b)) == before


def test_merge_of_rings_of_different_keep_raises_naming_both():
    a, b = ring(keep=0), ring(keep=2)
    before = frozen(a), frozen(b)
    with pytest.raises(ValueError, match=r"\(8, 0\).*\(8, 2\)"):
        BatchRotatingKVCache.merge([a, b])
    assert (frozen(a), frozen(b)) == before


@pytest.mark.parametrize("what", ["heads", "head_dim", "dtype"])
def test_merge_of_rings_of_different_shapes_raises(what):
    a = ring()
    b = RotatingKVCache(8, 2)
    b.update_and_fetch(*mismatches(1, 4)[what])
    before = frozen(a), frozen(b)
    with pytest.raises(ValueError, match="same heads, head dim and dtype"):
        BatchRotatingKVCache.merge([a, b])
    assert (frozen(a), frozen(b)) == before


@pytest.mark.parametrize("other", [(16, 0), (8, 2)])
def test_extend_with_a_batch_of_another_max_size_or_keep_raises(other):
    cache, more = batch(), batch(max_size=other[0], keep=other[1])
    before = frozen(more)
    raises_unchanged(cache, lambda: cache.extend(more), ValueError, "same max_size")
    assert frozen(more) == before


@pytest.mark.parametrize("merge", ["QuantizedKVCache", "BatchKVCache"])
@pytest.mark.parametrize("other", [(64, 4), (32, 8)])
def test_merge_of_quantized_caches_of_other_bits_or_group_size_raises(merge, other):
    a, b = quantized(), quantized(group_size=other[0], bits=other[1])
    before = frozen(a), frozen(b)
    owner = QuantizedKVCache if merge == "QuantizedKVCache" else BatchKVCache
    with pytest.raises(ValueError, match="same group size, bits and head dims"):
        owner.merge([a, b])
    assert (frozen(a), frozen(b)) == before


# Files


@pytest.fixture
def cache_file(tmp_path):
    path = tmp_path / "ring.safetensors"
    save_prompt_cache(str(path), [ring(n=12)])
    return path


def load_unchanged(path, error, match):
    before = path.read_bytes()
    with pytest.raises(error, match=match):
        load_prompt_cache(str(path))
    assert path.read_bytes() == before


def test_loading_a_truncated_cache_file_raises_saying_so(cache_file):
    cache_file.write_bytes(cache_file.read_bytes()[:-40])
    match = f"{re.escape(str(cache_file))}.*incomplete download or corrupt file"
    load_unchanged(cache_file, ValueError, match)


def test_loading_a_file_cut_inside_its_length_field_raises(cache_file):
    cache_file.write_bytes(cache_file.read_bytes()[:4])
    load_unchanged(
        cache_file, ValueError, f"{re.escape(str(cache_file))}.*Unable to read"
    )


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_loading_a_path_that_is_not_a_regular_file_raises_without_opening_it(
    tmp_path, kind
):
    """Upstream's ``mx.load`` opens a FIFO and waits for a writer, holding
    the GIL: the whole process freezes. Run in a subprocess, so that the
    old code fails the test by its timeout."""
    path = tmp_path / "c.safetensors"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    code = (
        "import sys, mlx_lm_patched\n"
        "from mlx_lm.models.cache import load_prompt_cache\n"
        "try:\n"
        "    load_prompt_cache(sys.argv[1])\n"
        "except ValueError as e:\n"
        "    print(e)\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(path)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"load_prompt_cache blocked on a {kind}")
    assert done.stdout.strip() == f"{path} is not a regular file", done.stderr


def test_loading_a_file_that_is_not_safetensors_raises(tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_bytes(b"these are not the tensors you are looking for")
    load_unchanged(path, ValueError, f"{re.escape(str(path))}.*Invalid json header")


def test_loading_a_file_with_a_corrupted_header_raises_naming_the_file(cache_file):
    data = bytearray(cache_file.read_bytes())
    data[20:40] = b"\xff" * 20
    cache_file.write_bytes(bytes(data))
    load_unchanged(cache_file, ValueError, cache_file.name)


def test_loading_a_plain_weights_file_raises_saying_it_is_not_a_prompt_cache(
    tmp_path,
):
    path = tmp_path / "model.safetensors"
    mx.save_safetensors(str(path), {"model.embed_tokens.weight": mx.zeros((8, 4))})
    load_unchanged(path, ValueError, "not a prompt cache")


def rewrite_metadata(path, **changes):
    arrays, metadata = mx.load(str(path), return_metadata=True)
    mx.save_safetensors(str(path), arrays, {**metadata, **changes})


def test_loading_a_file_naming_an_unknown_cache_class_raises_naming_it(cache_file):
    rewrite_metadata(cache_file, **{"1.0": "FancyKVCache"})
    load_unchanged(cache_file, ValueError, "unknown cache class.*FancyKVCache")


def test_loading_a_file_naming_a_non_cache_raises_naming_it(cache_file):
    rewrite_metadata(cache_file, **{"1.0": "save_prompt_cache"})
    load_unchanged(cache_file, ValueError, "save_prompt_cache")


def test_loading_a_file_missing_a_state_array_raises(cache_file):
    arrays, metadata = mx.load(str(cache_file), return_metadata=True)
    del arrays["0.0"]
    mx.save_safetensors(str(cache_file), arrays, metadata)
    load_unchanged(cache_file, ValueError, "0.0")


# Files whose states contradict their own metadata: raise naming the file,
# the layer and what is wrong, before any cache is built


def long_ring():
    cache = RotatingKVCache(512, 4)
    cache.update_and_fetch(*random_kv(1, 2, 366, 4))
    return cache


def wrapped_ring():
    cache = RotatingKVCache(366, 4)
    cache.update_and_fetch(*random_kv(1, 2, 400, 4))
    for _ in range(3):  # _idx moves off the end, unlike upstream's longer rings
        cache.update_and_fetch(*random_kv(1, 2, 1, 4))
    return cache


def kv_cache():
    cache = KVCache()
    cache.update_and_fetch(*random_kv(1, 2, 10, 4))  # held in 256 slots
    return cache


def batch_kv():
    cache = BatchKVCache([0, 2])
    cache.update_and_fetch(*random_kv(2, 2, 6, 4))
    return cache


def cut(keys):
    return keys[..., :50, :]


# (cache, {state entry of layer 1: new value}, {metadata entry: new value},
#  class named in the error, the inconsistency it names)
INCONSISTENT = {
    "offset past the stored tokens": (
        long_ring,
        {"1.2": 400},
        {},
        "RotatingKVCache",
        "366 tokens stored for offset 400",
    ),
    "keep > max_size": (
        long_ring,
        {"1.3": 600},
        {},
        "RotatingKVCache",
        "keep 600 and max_size 512",
    ),
    "max_size under the stored tokens": (
        wrapped_ring,
        {"1.4": 10},
        {},
        "RotatingKVCache",
        "366 tokens stored, more than max_size 10",
    ),
    "keys cut to 50 tokens": (
        long_ring,
        {"1.0": cut},
        {},
        "RotatingKVCache",
        r"keys \(1, 2, 50, 4\).*differ",
    ),
    "negative offset": (
        long_ring,
        {"1.2": -1},
        {},
        "RotatingKVCache",
        "offset -1 is negative",
    ),
    "max_size 0": (
        long_ring,
        {"1.4": 0},
        {},
        "RotatingKVCache",
        "keep 4 and max_size 0",
    ),
    "_idx off the ring": (
        long_ring,
        {"1.5": 3},
        {},
        "RotatingKVCache",
        "_idx 3 does not fit offset 366",
    ),
    "a ring state named QuantizedKVCache": (
        long_ring,
        {},
        {"1.1": "QuantizedKVCache"},
        "QuantizedKVCache",
        "6 state items, a QuantizedKVCache has 5 or 7",
    ),
    "KVCache offset past its buffer": (
        kv_cache,
        {"1.2": 300},
        {},
        "KVCache",
        "offset 300 is not within the 256 tokens",
    ),
    "quantized bits changed": (
        quantized,
        {"1.4": 4},
        {},
        "QuantizedKVCache",
        "packed width 16 and 1 groups do not fit bits=4, group_size=64",
    ),
    "quantized offset past the stored tokens": (
        quantized,
        {"1.2": 50},
        {},
        "QuantizedKVCache",
        "offset 50 is not within the 5",
    ),
    "batch offsets that do not add up": (
        batch_kv,
        {"1.2": mx.array([6, 9])},
        {},
        "BatchKVCache",
        r"offset \[6, 9\] \+ left_padding \[0, 2\] is not _idx 6",
    ),
    "batch ring with a row missing from left_padding": (
        batch,
        {"1.3": mx.array([0])},
        {},
        "BatchRotatingKVCache",
        "not one entry per row",
    ),
}


@pytest.mark.parametrize("case", INCONSISTENT)
def test_loading_an_inconsistent_state_raises_naming_file_layer_and_what(
    case, tmp_path, monkeypatch
):
    make, entries, meta, cls, what = INCONSISTENT[case]
    path = tmp_path / "edited.safetensors"
    save_prompt_cache(str(path), [make(), make()])
    arrays, metadata = mx.load(str(path), return_metadata=True)
    for k, value in entries.items():
        arrays[k] = value(arrays[k]) if callable(value) else mx.array(value)
    mx.save_safetensors(str(path), arrays, {**metadata, **meta})

    def build(cls, state):
        pytest.fail(f"{cls.__name__} built from an inconsistent file")

    monkeypatch.setattr(cache_module._BaseCache, "from_state", classmethod(build))
    where = f"^{re.escape(str(path))}: layer 1 \\({cls}\\): "
    load_unchanged(path, ValueError, where + ".*" + what)


def test_consistent_states_of_every_kind_load(tmp_path):
    caches = [long_ring(), wrapped_ring(), kv_cache(), batch_kv()]
    caches += every_cache_kind().values()
    path = str(tmp_path / "all.safetensors")
    save_prompt_cache(path, caches)
    assert [type(c) for c in load_prompt_cache(path)] == [type(c) for c in caches]


# Files written by upstream 0.32.2 (patches reverted) load and continue


def upstream_file(tmp_path, make):
    mlx_lm_patched.revert()
    cache, history = make()
    path = tmp_path / "upstream.safetensors"
    save_prompt_cache(str(path), [cache])
    mlx_lm_patched.apply(strict=True)
    return path, history


@pytest.mark.parametrize("n", [5, 8, 13])
def test_upstream_ring_file_loads_and_attends_like_the_reference(tmp_path, n):
    def make():
        cache = RotatingKVCache(8, 0)
        k, v = random_kv(1, 2, n, 4)
        for i in range(n):  # token by token: upstream's ring is right then
            cache.update_and_fetch(k[..., i : i + 1, :], v[..., i : i + 1, :])
        return cache, (k, v)

    path, (hk, hv) = upstream_file(tmp_path, make)
    before = path.read_bytes()
    (cache,) = load_prompt_cache(str(path))
    assert path.read_bytes() == before
    for S in (1, 3):
        k, v = random_kv(1, 2, S, 4)
        q = mx.random.normal((1, 2, S, 4))
        offset, mask = cache.offset, cache.make_mask(S)
        out = attend(q, *cache.update_and_fetch(k, v), mask)
        hk, hv = mx.concatenate([hk, k], axis=2), mx.concatenate([hv, v], axis=2)
        ref = attend(q, hk, hv, reference_mask(offset, S, 8))
        assert mx.allclose(out, ref, atol=1e-5).item()


@pytest.mark.parametrize("n", [6, 12])  # 12: upstream's ring holds all 12
def test_upstream_batch_ring_file_loads_and_keeps_decoding(tmp_path, n):
    def make():
        cache = BatchRotatingKVCache(8, [0, 2])
        k, v = random_kv(2, 2, n, 4)
        cache.update_and_fetch(k, v)
        return cache, (k, v)

    path, (hk, hv) = upstream_file(tmp_path, make)
    (cache,) = load_prompt_cache(str(path))
    assert cache.keep == 0 and cache.offset.tolist() == [n, n - 2]
    k, v = random_kv(2, 2, 1, 4)
    q = mx.random.normal((2, 2, 1, 4))
    mask = cache.make_mask(1)
    out = attend(q, *cache.update_and_fetch(k, v), mask)
    hk, hv = mx.concatenate([hk, k], axis=2), mx.concatenate([hv, v], axis=2)
    for b, pad in enumerate([0, 2]):
        ref = attend(
            q[b : b + 1],
            hk[b : b + 1, :, pad:],
            hv[b : b + 1, :, pad:],
            reference_mask(n - pad, 1, 8),
        )
        assert mx.allclose(out[b : b + 1], ref, atol=1e-5).item()


def test_upstream_quantized_file_loads_with_its_tokens_and_dtype(tmp_path):
    def make():
        cache = QuantizedKVCache(64, 8)
        k, v = random_kv(1, 2, 10, 64)
        cache.update_and_fetch(k, v)
        return cache, (k, v)

    path, (k, v) = upstream_file(tmp_path, make)
    (cache,) = load_prompt_cache(str(path))
    assert cache.size() == cache.offset == 10
    assert cache.dtype == "float32" and cache.head_dims == (64, 64)
    kv = cache.to_kv_cache()
    q = mx.dequantize(*mx.quantize(k, 64, 8), 64, 8)
    assert mx.array_equal(kv.keys, q).item()
    cache.update_and_fetch(*random_kv(1, 2, 1, 64))
    assert cache.size() == 11


# KV quantization mx.quantize cannot do: refused before the first token,
# not when the cache reaches quantized_kv_start


# Malformed files (#25): every one a ValueError naming the file, never a
# KeyError, a TypeError or a cache built from it.


def edit_file(path, arrays=None, metadata=None):
    """Rewrite ``path`` with ``arrays(arrays)`` and ``metadata(metadata)``."""
    a, m = mx.load(str(path), return_metadata=True)
    a = arrays(dict(a)) if arrays else a
    m = metadata(dict(m)) if metadata else m
    mx.save_safetensors(str(path), a, m)


def put(d, **changes):
    return {**d, **changes}


def drop(d, key):
    return {k: v for k, v in d.items() if k != key}


# name: (arrays edit, metadata edit); files of [ring(n=12), quantized()].
MALFORMED = {
    "keys as integers": (lambda a: put(a, **{"0.0": a["0.0"].astype(mx.int32)}), None),
    "keys as bool": (lambda a: put(a, **{"0.1": a["0.1"].astype(mx.bool_)}), None),
    "keys holding NaN": (lambda a: put(a, **{"0.0": a["0.0"] * mx.nan}), None),
    "keys holding inf": (lambda a: put(a, **{"0.0": a["0.0"] + mx.inf}), None),
    "offset stored as a float": (lambda a: put(a, **{"0.2": mx.array(12.0)}), None),
    "offset stored as a vector": (lambda a: put(a, **{"0.2": mx.array([1, 2])}), None),
    "string entry as floats": (
        None,
        lambda m: put(m, **{"2.1.1": "string"}),
    ),
    "a string in place of the scalar list": (
        None,
        lambda m: put(
            {k: v for k, v in m.items() if not k.startswith("2.")}, **{"2": "x"}
        ),
    ),
    "a scalar naming an array it lacks": (None, lambda m: put(m, **{"2.1.0": "9.9"})),
    "an unknown scalar type": (None, lambda m: put(m, **{"2.1.1": "complex"})),
    "classes as a string": (
        None,
        lambda m: put(
            {k: v for k, v in m.items() if not k.startswith("1.")}, **{"1": "KVCache"}
        ),
    ),
    "a class that is no cache": (None, lambda m: put(m, **{"1.0": "mx"})),
    "an array that is no state entry": (lambda a: put(a, weights=mx.zeros((2,))), None),
    "an array key with a letter": (lambda a: put(a, **{"0.x": mx.zeros((2,))}), None),
    "a third cache's state": (lambda a: put(a, **{"2.0": mx.zeros((2,))}), None),
    "a state array missing": (lambda a: drop(a, "1.1.0"), None),
    "metadata keys that do not unflatten": (None, lambda m: put(m, **{"0.1.x": "y"})),
    "quantized bits as a string": (None, lambda m: put(m, **{"2.7.1": "string"})),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_every_malformed_file_raises_a_value_error_naming_it(case, tmp_path):
    arrays, metadata = MALFORMED[case]
    path = tmp_path / "edited.safetensors"
    save_prompt_cache(str(path), [ring(n=12), quantized()])
    edit_file(path, arrays, metadata)
    load_unchanged(path, ValueError, re.escape(str(path)))


def test_a_file_whose_arrays_were_renamed_to_the_array_cache_class_raises(tmp_path):
    path = tmp_path / "edited.safetensors"
    save_prompt_cache(str(path), [kv_cache(), kv_cache()])
    edit_file(path, metadata=lambda m: put(m, **{"1.1": "ArraysCache"}))
    # ArraysCache holds any arrays: the file loads, but no attention model
    # takes it (see prompt_cache_mismatch).
    from mlx_lm.models.cache import prompt_cache_layout, prompt_cache_mismatch

    loaded = load_prompt_cache(str(path))
    expected = prompt_cache_layout([kv_cache(), kv_cache()])
    assert prompt_cache_mismatch(expected, loaded) == (
        "layer 1 holds ArraysCache, the model (2, 4, 4)"
    )


@pytest.mark.parametrize(
    "layers, heads, dim, why",
    [
        (4, 2, 4, "it has 4 layers, the model 2"),
        (2, 4, 4, r"layer 0 holds \(4, 4, 4\), the model \(2, 4, 4\)"),
        (2, 2, 8, r"layer 0 holds \(2, 8, 8\), the model \(2, 4, 4\)"),
    ],
)
def test_a_cache_of_other_layers_or_heads_does_not_fit(layers, heads, dim, why):
    from mlx_lm.models.cache import prompt_cache_layout, prompt_cache_mismatch

    def caches(n, h, d, quantize=False):
        out = []
        for _ in range(n):
            c = KVCache()
            c.update_and_fetch(*random_kv(1, h, 3, d))
            out.append(c.to_quantized(32, 8) if quantize and d % 32 == 0 else c)
        return out

    expected = prompt_cache_layout(caches(2, 2, 4))
    assert re.match(why, prompt_cache_mismatch(expected, caches(layers, heads, dim)))
    assert prompt_cache_mismatch(expected, caches(2, 2, 4)) is None
    quantized_model = prompt_cache_layout(caches(2, 2, 64))
    assert prompt_cache_mismatch(quantized_model, caches(2, 2, 64, True)) is None
