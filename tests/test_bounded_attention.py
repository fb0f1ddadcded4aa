"""Array-masked attention: the road each backend takes, the same output as
upstream, bounded scores where they are materialised, no sync."""

import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import base
from mlx_lm.models.cache import BatchKVCache, RotatingKVCache
from ringref import fake_backend, reference_mask, same

import mlx_lm_patched
from mlx_lm_patched.demo import tiny
from mlx_lm_patched.kernels.bounded_attention import scaled_dot_product_attention

pytestmark = pytest.mark.usefixtures("patched", "cpu_device")


def upstream_sdpa():
    return mlx_lm_patched.get_original(
        "mlx_lm.models.base", "scaled_dot_product_attention"
    )


def paths():
    """The new module ``mlx_lm.models.bounded_attention``, once patched."""
    return sys.modules["mlx_lm.models.bounded_attention"]


def inputs(B=1, H=8, N=512, L=1536, D=32, dtype=mx.float32, padding=None):
    q, k, v = (mx.random.normal((B, H, n, D)).astype(dtype) for n in (N, L, L))
    mask = reference_mask(L - N, N, 600, keep=4)  # a ring's window past the ring
    if padding is not None:  # left padding per row: its first queries see nothing
        pad = mx.array(padding)[:, None, None, None]
        mask = mask & (mx.arange(L) >= pad) & (mx.arange(L - N, L)[:, None] >= pad)
    mx.eval(q, k, v, mask)
    return q, k, v, mask


@pytest.fixture
def backend(monkeypatch):
    """``backend(name)``: the patched attention sees that MLX backend."""
    return lambda name: fake_backend(monkeypatch, name)


@pytest.fixture
def cudnn_only(monkeypatch):
    """CUDA's unfused road closed: every call cuDNN takes goes to it."""
    monkeypatch.setattr(paths(), "UNFUSED_KEYS", 0)
    monkeypatch.setattr(paths(), "FEW_QUERIES", 0)


@pytest.fixture
def fused_calls(monkeypatch):
    """The masks ``mx.fast.scaled_dot_product_attention`` is called with."""
    calls, sdpa = [], mx.fast.scaled_dot_product_attention
    monkeypatch.setattr(
        mx.fast,
        "scaled_dot_product_attention",
        lambda *a, **k: calls.append(k["mask"]) or sdpa(*a, **k),
    )
    return calls


def callers_of(fn, monkeypatch):
    """Count the ``mx.eval`` calls made with ``fn``'s code on the stack."""
    calls, evaluate = [], mx.eval

    def counting(*args, **kwargs):
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not fn.__code__:
            frame = frame.f_back
        calls.append(frame is not None)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(mx, "eval", counting)
    return calls


@pytest.mark.parametrize(
    "device, metal, cuda, name",
    [
        (mx.cpu, False, False, "cpu"),
        (mx.gpu, True, False, "metal"),
        (mx.gpu, False, True, "cuda"),
        (mx.cpu, False, True, "cpu"),  # --device cpu on a CUDA machine
    ],
)
def test_the_backend_is_the_default_device_s(monkeypatch, device, metal, cuda, name):
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(device))
    monkeypatch.setattr(mx.metal, "is_available", lambda: metal)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: cuda)
    assert paths().sdpa_backend() == name


@pytest.mark.parametrize(
    "name, dtype, N, D, path",
    [
        ("cuda", mx.bfloat16, 64, 128, "additive"),
        ("cuda", mx.float16, 64, 64, "additive"),
        ("cuda", mx.float32, 64, 128, "scores"),  # cuDNN: half precision only
        ("cuda", mx.bfloat16, 64, 256, "scores"),  # cuDNN: head dim <= 128
        ("cuda", mx.bfloat16, 1, 128, "scores"),  # decode with an array mask
        ("metal", mx.bfloat16, 64, 128, "fused"),
        ("metal", mx.float32, 64, 80, "fused"),
        ("metal", mx.bfloat16, 64, 256, "scores"),
        ("metal", mx.bfloat16, 64, 32, "scores"),
        ("metal", mx.bfloat16, 1, 128, "fused"),
        ("cpu", mx.bfloat16, 64, 128, "scores"),
    ],
)
def test_each_backend_takes_its_path_for_an_array_mask(
    backend, name, dtype, N, D, path
):
    backend(name)
    q, k, v, mask = inputs(H=4, N=N, L=4160, D=D, dtype=dtype)
    assert paths().attention_path(q, k, v, mask) == path
    for no_array in ("causal", None):
        assert paths().attention_path(q, k, v, no_array) == "fused"


@pytest.mark.parametrize(
    "B, H, N, L, path",
    [
        (1, 32, 580, 1604, "unfused"),  # a chunk through a sliding window's layer
        (1, 32, 1024, 4096, "unfused"),
        (1, 4, 1025, 2048, "additive"),
        (1, 4, 580, 4097, "additive"),  # a chunk through a global layer
        (1, 32, 3, 24003, "unfused"),  # a prompt sent again: its last few tokens
        (1, 4, 16, 9000, "unfused"),
        (1, 4, 17, 9000, "additive"),
        (8, 32, 580, 1604, "additive"),  # 8 rows: 238M scores
        (4, 32, 16, 131072, "additive"),
    ],
)
def test_cuda_attends_small_scores_unfused(backend, B, H, N, L, path):
    """cuDNN's calls are CUDA graph nodes MLX cannot update: a call with few
    queries, or a chunk over a window's keys, is composed as MLX does, its
    scores (rows x heads x queries x keys) at most ``UNFUSED_SCORES``."""
    backend("cuda")
    q = mx.zeros((B, H, N, 64), mx.bfloat16)
    k = v = mx.zeros((B, 4, L, 64), mx.bfloat16)
    mask = mx.ones((B, 1, N, L), mx.bool_)
    assert paths().attention_path(q, k, v, mask) == path


@pytest.mark.parametrize(
    "shape", [(2, 8, 37, 300), (2, 8, 1, 300), (2, 1, 37, 300), (1, 37, 300), (37, 300)]
)
@pytest.mark.parametrize("additive", [False, True])
def test_unfused_is_mlx_s_composition_for_every_mask_shape(shape, additive):
    """Per-head masks, masks broadcast over queries or rows, boolean or
    additive: ``unfused`` gives MLX's own output bit for bit (on the CPU,
    where MLX composes every call)."""
    q = mx.random.normal((2, 8, 37, 64)).astype(mx.bfloat16)
    k, v = (mx.random.normal((2, 2, 300, 64)).astype(mx.bfloat16) for _ in "kv")
    mask = (mx.random.uniform(shape=shape) < 0.7) | (mx.arange(300) == 0)
    if additive:
        mask = paths().additive_mask(mask, mx.bfloat16)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.1, mask=mask)
    assert same(paths().unfused(q, k, v, 0.1, mask), want)


@pytest.mark.parametrize(
    "name, L", [("cpu", 768), ("metal", 768), ("cuda", 768), ("cuda", 4160)]
)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_every_path_is_bit_identical_to_upstream(backend, name, L, dtype):
    """Boolean masks with rows that see nothing (left padding) too: the
    additive mask's minimum gives the same softmax as upstream's ``where``;
    CUDA's unfused road (768 keys) is MLX's own composition."""
    backend(name)
    q, k, v, mask = inputs(B=2, H=4, N=256, L=L, dtype=dtype, padding=[0, 300])
    want = upstream_sdpa()(q, k, v, None, 0.2, mask)
    got = scaled_dot_product_attention(q, k, v, None, 0.2, mask, max_scores=1 << 20)
    assert same(got, want)


def test_cuda_gets_one_fused_call_with_an_additive_mask(backend, fused_calls):
    backend("cuda")
    q, k, v, mask = inputs(L=6144, D=64, dtype=mx.bfloat16)
    mx.eval(scaled_dot_product_attention(q, k, v, None, 0.2, mask, max_scores=1))
    (m,) = fused_calls
    assert m.dtype == mx.bfloat16 and m.shape == mask.shape


@pytest.mark.parametrize(
    "dtype, K", [(mx.bfloat16, 6143), (mx.float16, 97), (mx.bfloat16, 64)]
)
def test_the_additive_mask_is_a_view_of_rows_padded_to_16_bytes(monkeypatch, dtype, K):
    """cuDNN reads a bias with unaligned rows slowly: the conversion is built
    over rows of a multiple of 16 bytes and cut back to the mask's shape."""
    built, where = [], mx.where
    monkeypatch.setattr(
        mx, "where", lambda c, *a: built.append(c.shape) or where(c, *a)
    )
    mask = mx.random.uniform(shape=(2, 1, 3, K)) < 0.5
    got = paths().additive_mask(mask, dtype)
    assert built == [(2, 1, 3, -(-K // 8) * 8)]
    assert got.shape == mask.shape and got.dtype == dtype
    assert mx.array_equal(got == 0, mask).item()
    assert mx.array_equal(got < 0, ~mask).item()


@pytest.mark.usefixtures("cudnn_only")
def test_cuda_makes_a_model_call_s_mask_additive_once(backend, fused_calls):
    """Every layer gets the same mask: one additive array, not one a layer."""
    backend("cuda")
    config = tiny.model_config("llama", head_dim=64, hidden_size=128)
    model = tiny.build_model(config, dtype="bfloat16")
    ring = [RotatingKVCache(64, keep=4) for _ in model.layers]
    model(mx.arange(48)[None], cache=ring)
    for n in (48, 30):  # past the ring
        fused_calls.clear()
        mx.eval(model(mx.arange(n)[None] % 512, cache=ring))
        masks = [m for m in fused_calls if isinstance(m, mx.array)]
        assert len(masks) == len(model.layers) > 1
        assert len({id(m) for m in masks}) == 1 and masks[0].dtype == mx.bfloat16


def test_metal_gets_one_fused_call_with_the_mask_as_it_is(backend, fused_calls):
    backend("metal")
    q, k, v, mask = inputs(D=64, dtype=mx.bfloat16)
    scaled_dot_product_attention(q, k, v, None, 0.2, mask, max_scores=1)
    assert len(fused_calls) == 1 and fused_calls[0] is mask


@pytest.mark.parametrize(
    "name, D, fraction, blocks, evals",
    [
        ("cpu", 32, 2, 16, 0),
        ("cuda", 256, 2, 2, 2),
        ("metal", 256, 2, 2, 2),
        ("cuda", 256, 8 / 3, 4, 4),  # 192 queries' budget: blocks of 128
    ],
)
def test_materialised_scores_go_in_query_blocks(
    monkeypatch, backend, fused_calls, name, D, fraction, blocks, evals
):
    """CPU: chained blocks of an eighth of the budget, never evaluated; a GPU:
    blocks of the budget rounded down to a power of two queries, each
    evaluated (a chain bounds nothing there)."""
    backend(name)
    q, k, v, mask = inputs(N=512, L=1536, D=D, dtype=mx.bfloat16)
    calls = callers_of(base.scaled_dot_product_attention, monkeypatch)
    scores = 4 * 8 * 512 * 1536
    budget = int(scores / fraction)
    out = scaled_dot_product_attention(q, k, v, None, 0.2, mask, max_scores=budget)
    assert len(fused_calls) == blocks and sum(calls) == evals
    assert all(
        m.dtype == mx.bool_ and m.shape[-2] == 512 // blocks for m in fused_calls
    )
    assert same(out, upstream_sdpa()(q, k, v, None, 0.2, mask))


@pytest.mark.parametrize("mask", ["causal", None])
def test_calls_without_an_array_mask_are_not_split(mask):
    q, k, v, _ = inputs(N=64, L=64)
    out = scaled_dot_product_attention(q, k, v, None, 0.2, mask, max_scores=1)
    ref = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask=mask)
    assert mx.array_equal(out, ref).item()


def peak_above_active(**kwargs):
    q, k, v, mask = inputs()
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    before = mx.get_active_memory()
    mx.eval(scaled_dot_product_attention(q, k, v, None, 0.2, mask, **kwargs))
    return mx.get_peak_memory() - before


@pytest.mark.parametrize("fraction", [2, 4])
def test_blocked_call_holds_no_more_than_its_budget(fraction):
    """Without any eval between the blocks: lazily, MLX would compute every
    block's scores before the first softmax (the whole call's peak)."""
    scores = 4 * 8 * 512 * 1536  # float32, every head, query and key: 24 MiB
    output = 4 * 8 * 512 * 32
    whole = peak_above_active()
    blocked = peak_above_active(max_scores=scores // fraction)
    assert whole >= scores
    assert blocked <= scores // fraction + output


def test_blocked_attention_compiles_and_gives_the_same_output():
    """``mx.eval`` would raise inside ``mx.compile``."""
    q, k, v, mask = inputs()

    def f(q, k, v, mask):
        return scaled_dot_product_attention(
            q, k, v, None, 0.2, mask, max_scores=1 << 20
        )

    assert same(mx.compile(f)(q, k, v, mask), f(q, k, v, mask))


# A model's forward pass: no sync from the attention paths.


@pytest.mark.parametrize("name", ["cpu", "cuda", "metal"])
def test_a_forward_pass_has_no_sync_in_attention(monkeypatch, backend, name):
    """A ring past its window (chunked prefill, then decode) and a
    left-padded batch, scores budgets small enough to block on CPU; head dim
    64 in bfloat16, which the CUDA and Metal kernels fuse."""
    backend(name)
    for fn in (base.scaled_dot_product_attention,):
        monkeypatch.setattr(fn, "__defaults__", (None, 1 << 12))
    config = tiny.model_config("llama", head_dim=64, hidden_size=128)
    model = tiny.build_model(config, dtype="bfloat16")
    calls = callers_of(base.scaled_dot_product_attention, monkeypatch)

    ring = [RotatingKVCache(64, keep=4) for _ in model.layers]
    for n in (48, 48, 1, 1):
        model(mx.arange(n)[None] % 512, cache=ring)
    padded = [BatchKVCache(left_padding=[0, 10]) for _ in model.layers]
    for n in (40, 1):
        model(mx.arange(2 * n).reshape(2, n) % 512, cache=padded)
    assert calls == [False] * len(calls)


def greedy(model, cache, prompt, steps, chunk):
    tokens = mx.array(prompt)
    for i in range(0, len(prompt) - 1, chunk):
        model(tokens[None, i : min(i + chunk, len(prompt) - 1)], cache=cache)
    y, out = tokens[-1:], []
    for _ in range(steps):
        y = mx.argmax(model(y[None], cache=cache)[0, -1:], axis=-1)
        out.append(y.item())
    return out


@pytest.mark.parametrize("name", ["cpu", "cuda", "metal"])
def test_a_ring_past_its_window_generates_upstream_s_tokens(backend, name):
    backend(name)
    config = tiny.model_config("llama", head_dim=32, hidden_size=128)
    model = tiny.build_model(config, dtype="bfloat16")
    prompt = np.random.default_rng(1).integers(0, 512, 300).tolist()

    def run():
        cache = [RotatingKVCache(128, keep=4) for _ in model.layers]
        return greedy(model, cache, prompt, 40, chunk=100)

    ours = run()
    mlx_lm_patched.revert("quantized_attention", "bounded_attention")
    assert ours == run()


def test_buckets_are_two_a_doubling_and_cover_their_sizes():
    """cuDNN builds a graph per shape: a size is rounded up to one of two
    buckets per doubling, less than 1.5x it, a bucket its own bucket."""
    sizes = range(1, 5000)
    for n in sizes:
        b = paths().bucket(n)
        assert n <= b == paths().bucket(b) and (b == 64 or b < 1.5 * n)
    buckets = {paths().bucket(n) for n in sizes}
    for k in range(7, 13):
        assert len([b for b in buckets if 1 << (k - 1) < b <= 1 << k]) == 2


@pytest.mark.usefixtures("cudnn_only")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
@pytest.mark.parametrize("N, L", [(70, 300), (520, 6039), (33, 1025)])
def test_cuda_calls_run_padded_to_their_bucket_with_the_same_output(
    backend, fused_calls, dtype, N, L
):
    """The fused call sees the bucket's shape; the padding (masked keys,
    rows seeing one key) changes no output bit."""
    backend("cuda")
    q, k, v, mask = inputs(B=2, H=4, N=N, L=L, D=32, dtype=dtype, padding=[0, 9])
    got = scaled_dot_product_attention(q, k, v, None, 0.2, mask)
    (m,) = fused_calls
    assert m.shape[-2:] == (paths().bucket(N), paths().bucket(L))
    plain = mx.fast.scaled_dot_product_attention(
        q, k, v, scale=0.2, mask=paths().additive_mask(mask, dtype)
    )
    assert got.shape == plain.shape and same(got, plain)
