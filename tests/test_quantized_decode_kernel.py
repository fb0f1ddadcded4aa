"""The CUDA decode kernel's arithmetic, in plain ``mx`` ops on CPU: the split
softmax over keys dequantized on the fly equals attention over the
dequantized cache; and which calls reach the kernel. The kernel itself is
checked on a GPU by ``python -m mlx_lm_patched.bench qdecode`` (its
``check`` part)."""

import hashlib
import os
import stat
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.kernels import quantized_decode as qa
from mlx_lm.kernels import quantized_decode_partial, quantized_decode_source
from mlx_lm.kernels.quantized_decode_mma import _DECODE_MMA
from mlx_lm.models import base, cache, quantized_layout
from mlx_lm.models.cache import RotatingKVCache
from ringref import fake_backend, random_kv, single_stream

import mlx_lm_patched
from mlx_lm_patched.demo import tiny
from mlx_lm_patched.kernels.quantized_decode_reference import decode_attention_reference

pytestmark = pytest.mark.usefixtures("patched", "cpu_device")


def dequantized_attention(queries, q_keys, q_values, scale, mask, group_size, bits):
    """The old road: the cache dequantized in float32, then fused attention."""
    D = queries.shape[-1]
    keys, values = (
        mx.dequantize(*x, group_size=group_size, bits=bits, dtype=mx.float32)[..., :D]
        for x in (q_keys, q_values)
    )
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask
    )


def quantized_cache(B, n_kv, kL, D, group_size, bits):
    """Keys and values as ``QuantizedKVCache`` holds them: head dims no group
    size divides zero-padded to a multiple of 32 (80 to 96)."""
    width = (D + 31) // 32 * 32 if D % group_size else D
    pad = [(0, 0)] * 3 + [(0, width - D)]
    k, v = random_kv(B, n_kv, kL, D)
    return [mx.quantize(mx.pad(x, pad), group_size, bits) for x in (k, v)]


def close(a, b):
    return a.shape == b.shape and mx.allclose(a, b, atol=2e-5, rtol=1e-4).item()


@pytest.mark.parametrize("D, group_size", [(64, 64), (80, 32), (96, 32), (128, 128)])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("n_repeats", [1, 4, 8])
def test_split_softmax_over_packed_keys_equals_dequantized_attention(
    D, group_size, bits, n_repeats
):
    rng = np.random.default_rng(D + bits + n_repeats)
    q_keys, q_values = quantized_cache(1, 2, 203, D, group_size, bits)
    queries = mx.array(rng.standard_normal((1, 2 * n_repeats, 1, D), dtype=np.float32))
    want = dequantized_attention(queries, q_keys, q_values, 0.1, None, group_size, bits)
    for splits in (1, 3, 7):
        got = decode_attention_reference(
            queries, q_keys, q_values, 0.1, None, group_size, bits, splits
        )
        assert close(got, want), splits


def test_a_step_s_lengths_are_a_view_of_one_zero_made_once():
    """A decode step's lengths (an array's shape) are made once a step, each
    a view of the same zero: no kernel a step."""
    a = quantized_layout._decode_lengths(200, 11)
    assert quantized_layout._decode_lengths(200, 11) is a and a.shape == (201, 12)
    zero = quantized_layout._decode_lengths_made[None]
    b = quantized_layout._decode_lengths(201, 12)
    assert b.shape == (202, 13) and quantized_layout._decode_lengths_made[None] is zero
    assert len(quantized_layout._decode_lengths_made) == 2  # the zero and this step's


@pytest.mark.parametrize("D, group_size", [(64, 64), (80, 32)])
@pytest.mark.parametrize("L, mask", [(1, None), (3, "causal")])
def test_a_cache_s_tail_is_one_more_range_read_as_it_is(D, group_size, L, mask):
    """Keys as a QuantizedKVCache decode step hands them out (whole buffers,
    garbage past the packed keys and the tail's): attention over the packed
    keys dequantized and the tail's as they are."""
    rng = np.random.default_rng(D + L)
    q_keys, q_values = quantized_cache(1, 2, 240, D, group_size, 4)
    tails = random_kv(1, 2, 16, D)
    queries = mx.array(rng.standard_normal((1, 8, L, D), dtype=np.float32))
    lengths = quantized_layout._decode_lengths(200, 11)
    five = [(*p, t, lengths) for p, t in zip((q_keys, q_values), tails)]
    keys, values = (
        mx.concatenate(
            [
                mx.dequantize(*[x[:, :, :200] for x in p], group_size, 4)[..., :D],
                t[:, :, :11],
            ],
            axis=2,
        )
        for p, t in zip((q_keys, q_values), tails)
    )
    want = mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=0.1, mask=mask
    )
    for splits in (1, 3, 7):
        got = decode_attention_reference(
            queries, *five, 0.1, mask, group_size, 4, splits
        )
        assert close(got, want), splits


@pytest.mark.parametrize("L", [1, 4])
@pytest.mark.parametrize("bits", [4, 8])
def test_a_wrapped_ring_s_mask_comes_in_as_an_array(L, bits):
    """A quantized ring past its size (sinks kept, the window wrapped): its
    own mask, boolean, over its own slots."""
    rng = np.random.default_rng(L)
    ring = RotatingKVCache(max_size=64, keep=4).to_quantized(group_size=64, bits=bits)
    for n in (50, 30, 7):  # past 64: wrapped
        ring.update_and_fetch(*random_kv(1, 2, n, 64))
    q_keys, q_values = ring.update_and_fetch(*random_kv(1, 2, L, 64))
    mask = ring.make_mask(L, return_array=True) if L > 1 else None
    if L == 1:  # a decode step: no mask, every slot visible
        assert ring.make_mask(1) is None
    queries = mx.array(rng.standard_normal((1, 8, L, 64), dtype=np.float32))
    if L > 1:
        assert isinstance(mask, mx.array) and mask.dtype == mx.bool_
        assert not mx.all(mask).item()
    want = dequantized_attention(queries, q_keys, q_values, 0.1, mask, 64, bits)
    got = decode_attention_reference(queries, q_keys, q_values, 0.1, mask, 64, bits, 5)
    assert close(got, want)


@pytest.mark.parametrize("kind", ["boolean", "additive", "causal"])
def test_a_padded_batch_s_mask_hides_each_row_s_padding(kind):
    """Two rows left-padded by 0 and 150 tokens, 2 queries each: a split that
    is all padding for a row adds nothing to that row."""
    rng = np.random.default_rng(0)
    q_keys, q_values = quantized_cache(2, 2, 240, 128, 64, 8)
    queries = mx.array(rng.standard_normal((2, 8, 2, 128), dtype=np.float32))
    causal = mx.arange(240) <= mx.arange(238, 240)[:, None]
    mask = (mx.arange(240) >= mx.array([0, 150])[:, None, None, None]) & causal
    if kind == "additive":
        mask = mx.where(mask, 0.0, -1e9)
    elif kind == "causal":
        mask = "causal"
    want = dequantized_attention(queries, q_keys, q_values, 0.1, mask, 64, 8)
    for splits in (1, 4, 9):  # 9: splits 0-4 all padding for row 1
        got = decode_attention_reference(
            queries, q_keys, q_values, 0.1, mask, 64, 8, splits
        )
        assert close(got, want), splits


def test_splits_fill_the_target_and_keep_a_minimum_of_keys():
    assert qa.decode_splits(1, 8, 32768) == qa.DECODE_BLOCKS // 8
    assert qa.decode_splits(1, 8, 100) == 1
    assert qa.decode_splits(64, 8, 32768) == 1
    n = qa.decode_splits(1, 8, 1000)
    assert n * qa.DECODE_MIN_KEYS <= 1000


@pytest.mark.parametrize("width", [64, 96, 128])
@pytest.mark.parametrize("dims_per_lane", [8, 16])
def test_a_key_s_lanes_cover_its_width_in_one_warp(monkeypatch, width, dims_per_lane):
    monkeypatch.setattr(qa, "DECODE_DIMS_PER_LANE", dims_per_lane)
    monkeypatch.setattr(qa, "DECODE_MMA", False)
    kernel, partial, reduce = qa._decode_launch(
        1, 32, 1, width, 8, width, 8, 32, 0, False, 32, mx.bfloat16, 0.1
    )
    assert kernel == "partial"
    t = dict(partial["template"])
    lanes = t["TPK"]
    assert lanes & (lanes - 1) == 0 and 128 % lanes == 0  # groups tile a block
    assert lanes * dims_per_lane >= width > (lanes // 2) * dims_per_lane
    assert dict(reduce["template"])["MAX_SPLITS"] >= 32  # the splits asked for


def test_launch_arguments_are_made_once_per_shape_and_setting(monkeypatch):
    monkeypatch.setattr(qa, "DECODE_MMA", False)
    args = (1, 32, 1, 128, 8, 128, 4, 64, 0, False, 32, mx.bfloat16, 0.1)
    first = qa._decode_launch(*args)[1]
    assert qa._decode_launch(*args)[1] is first
    monkeypatch.setattr(qa, "DECODE_KEYS_PER_ITER", 3)
    other = qa._decode_launch(*args)[1]
    assert other is not first and ("KT", 3) in other["template"]
    monkeypatch.setattr(qa, "DECODE_MMA", True)
    kernel, mma, _ = qa._decode_launch(*args)
    assert kernel == "mma" and ("PF", True) in mma["template"]
    monkeypatch.setattr(qa, "DECODE_PREFETCH", False)
    assert ("PF", False) in qa._decode_launch(*args)[1]["template"]


@pytest.mark.parametrize("name", ["mma", "partial", "reduce"])
def test_a_kernel_s_source_comes_from_files_its_call_includes(
    monkeypatch, tmp_path, name
):
    """A kernel's call carries a few hundred bytes (MLX copies and hashes
    them at every call and launch): its constants, the inputs' shapes and
    strides its source names (which MLX then passes, as with the whole
    source), and #includes of its source and header, each written once to
    a file named by its hash in a folder of this user's alone; a file
    changed on disk is written again before use, and a folder others may
    write to, or none at all, keeps the source in the call."""
    made = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw))
    monkeypatch.setattr(qa, "_decode_kernels", {})
    monkeypatch.setenv("MLX_LM_PATCHED_CUDA_DIR", str(tmp_path / "cuda"))
    monkeypatch.setattr(qa, "DECODE_MMA", name == "mma")
    args = (1, 32, 1, 128, 8, 128, 8, 64, 1, False, 16, mx.bfloat16, 0.1, 64)
    first, partial, reduce = qa._decode_launch(*args)
    template = (reduce if name == "reduce" else partial)["template"]
    qa._decode_kernel(name, template)
    (call,) = made
    partial, source = quantized_decode_partial, quantized_decode_source
    body = {"mma": _DECODE_MMA, "partial": partial._DECODE_PARTIAL}
    body = qa._minified(body.get(name, partial._DECODE_REDUCE))
    header = source._DECODE_DEFINES if name == "reduce" else source._DECODE_HEADER
    header = qa._minified(header)
    files = sorted((tmp_path / "cuda").iterdir())
    assert sorted(f.read_text() for f in files) == sorted([body, header])
    assert stat.S_IMODE((tmp_path / "cuda").stat().st_mode) == 0o700
    path = {}
    for text, kept in ((body, call["source"]), (header, call["header"])):
        name = hashlib.sha256(text.encode()).hexdigest()[:32] + ".cuh"
        path[text] = tmp_path / "cuda" / name
        assert f'#include "{path[text]}"' in kept
    assert len(call["source"]) < 1024 and len(call["header"]) < 256
    for n in call["input_names"]:
        for x in ("shape", "strides", "ndim"):
            named = f"{n}_{x}"
            assert (named in call["source"]) == (named in header + body), named
    path[body].write_text("garbage")
    assert qa._source_file(body) == f'#include "{path[body]}"\n'
    assert path[body].read_text() == body
    os.chmod(tmp_path / "cuda", 0o777)
    assert qa._source_file(body) == body
    (tmp_path / "a file").write_text("")  # no folder can be made there
    monkeypatch.setenv("MLX_LM_PATCHED_CUDA_DIR", str(tmp_path / "a file"))
    assert qa._source_file(body) == body


@pytest.mark.parametrize("mma", [True, False])
def test_the_scale_is_compiled_in_not_read_from_an_array(monkeypatch, tmp_path, mma):
    """A first kernel's scale is a constant of its source, the exact double
    (a hexadecimal literal, which a float constant rounds as float32 does),
    not an input: MLX keeps a one-element array in managed memory, and
    every layer's kernel read it (9-14 us a layer on an H200). Two scales
    make two kernels."""
    made = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw) or kw)
    monkeypatch.setattr(qa, "_cuda_kernels", True)
    monkeypatch.setattr(qa, "_decode_kernels", {})
    monkeypatch.setattr(qa, "_decode_launches", {})
    monkeypatch.setenv("MLX_LM_PATCHED_CUDA_DIR", str(tmp_path))
    monkeypatch.setattr(qa, "DECODE_MMA", mma)
    args = (1, 32, 1, 128, 8, 128, 8, 64, 0, False, 16, mx.bfloat16)
    scale = 128**-0.5
    qa._decode_launch(*args, scale)
    qa._decode_launch(*args, 0.25)
    first, other = made[0], made[2]  # each with its merge kernel
    assert "scale" not in first["input_names"] and "SC" not in made[1]["source"]
    assert f"constexpr float SC = {scale.hex()};" in first["source"]
    assert "constexpr float SC = 0x1.0000000000000p-2;" in other["source"]
    assert float.fromhex(scale.hex()) == scale
    assert qa._c_value(float("-inf")).startswith("-cuda::std::numeric_limits<float>")
    assert qa._c_value(float("nan")).endswith("quiet_NaN()")
    assert qa._c_value(True) == "true" and qa._c_value(64) == "64"


@pytest.mark.parametrize("mma", [True, False])
def test_a_tail_is_one_more_range_of_the_first_kernel(monkeypatch, mma):
    """A cache's tail (``tail`` > 1) takes a block of its own after the
    ranges' (one more partial result a KV head); the merge kernel reads the
    partial results alone."""
    monkeypatch.setattr(qa, "DECODE_MMA", mma)
    args = (1, 32, 1, 128, 8, 128, 8, 64, 0, False, 16, mx.bfloat16, 0.1)
    _, plain, _ = qa._decode_launch(*args)
    _, tailed, reduce = qa._decode_launch(*args, 64)
    threads = plain["call"]["threadgroup"][0]
    assert plain["call"]["grid"][0] == 16 * threads
    assert tailed["call"]["grid"][0] == 17 * threads
    assert [s[2] for s in tailed["call"]["output_shapes"]] == [17]
    assert ("TAIL", 64) in tailed["template"]
    assert dict(reduce["template"])["MAX_SPLITS"] >= 17
    assert "TAIL" not in dict(reduce["template"])


def test_a_cache_s_decode_step_has_the_kernel_write_its_tail(monkeypatch):
    """A ``QuantizedKVCache`` decode step writes its tail lazily: the first
    kernel reads the tail before the step and the step's tokens, writes the
    tail with them (two more outputs of the tail's shape), and the cache
    takes that tail; a fetch the cache has moved past hands nothing over.
    Only that first call merges its ranges with the cache's counters."""
    made, bf16 = [], mx.bfloat16

    def kernel(name, template):
        def call(inputs, grid, threadgroup, output_shapes, output_dtypes):
            made.append((name, dict(template), inputs))
            return [
                mx.full(s, len(made), t) for s, t in zip(output_shapes, output_dtypes)
            ]

        return call

    monkeypatch.setattr(qa, "_cuda_kernels", True)
    monkeypatch.setattr(qa, "_decode_kernel", kernel)
    monkeypatch.setattr(qa, "_decode_launches", {})
    c = cache.QuantizedKVCache(bits=8)
    c.decode_tail = 8
    c.update_and_fetch(*random_kv(1, 2, 20, 64, dtype=bf16))
    c.update_and_fetch(*random_kv(1, 2, 1, 64, dtype=bf16))  # tail: 1 token
    step = random_kv(1, 2, 1, 64, dtype=bf16)
    before = c._written_tail()  # the last step's tokens, written here
    q_keys, q_values = c.update_and_fetch(*step)
    assert c._tail is before  # no write made
    assert q_keys[3] is before[0] and q_values[3] is before[1]
    written = [x.written()[:, :, :2] for x in (q_keys, q_values)]  # another reader's
    assert mx.array_equal(written[0][:, :, 1:], step[0]).item()
    assert mx.array_equal(written[1][:, :, 1:], step[1]).item()
    q = mx.ones((1, 8, 1, 64), mx.bfloat16)
    out = qa.quantized_decode_attention(q, q_keys, q_values, 0.1, None, 64, 8)
    ((first, t, inputs),) = made  # the ranges merged in the first kernel
    assert first == "mma" and t["WT"] and t["MERGE"] and t["TAIL"] == 8
    assert inputs[7] is before[0] and inputs[8] is before[1]  # tk, tv
    assert inputs[9] is step[0] and inputs[10] is step[1]  # nk, nv
    assert inputs[-1] is c._counters and c._counters.dtype == mx.uint32
    assert c._counters.nbytes > 8  # 2 heads: 8 bytes would be managed memory
    assert [x.shape for x in c._tail] == [(1, 2, 8, 64)] * 2
    assert all(mx.all(x == 1).item() for x in c._tail)  # the kernel's outputs
    assert out.shape == q.shape and mx.all(out == 1).item()
    # A second call on the fetch (the cache keeps the first's tail) leaves
    # the counters alone: a second kernel merges its ranges.
    made.clear()
    first_tail = c._tail
    qa.quantized_decode_attention(q, q_keys, q_values, 0.1, None, 64, 8)
    (first, t, inputs), (reduce, _, _) = made
    assert not t["MERGE"] and reduce == "reduce" and inputs[-1] is not c._counters
    assert c._tail is first_tail
    c.compact()  # the tail dropped: a stale fetch still attends, unmerged
    made.clear()
    qa.quantized_decode_attention(q, q_keys, q_values, 0.1, None, 64, 8)
    assert not made[0][1]["MERGE"] and c._tail is None
    c.update_and_fetch(*random_kv(1, 2, 1, 64, dtype=bf16))  # past q_keys' step
    kept = c._tail
    c._wrote_tail(q_keys, *kept[::-1])
    assert c._tail is kept
    # DECODE_MERGE off: a second kernel merges the first one's ranges.
    monkeypatch.setattr(qa, "DECODE_MERGE", False)
    made.clear()
    qa.quantized_decode_attention(q, *c.update_and_fetch(*step), 0.1, None, 64, 8)
    (first, t, _), (reduce, _, parts) = made
    assert not t["MERGE"] and reduce == "reduce"
    assert len(parts) == 1 and parts[0].shape[-1] == 4 * (64 + 2)


@pytest.mark.parametrize(
    "n_q_heads, L, width, kernel",
    [
        (32, 1, 128, "mma"),  # 4 rows a KV head: a decode step, GQA 4
        (64, 1, 64, "mma"),  # 8 rows
        (32, 2, 128, "mma"),  # 2 queries, 8 rows
        (32, 4, 128, "partial"),  # 16 rows: past the n8 tile
        (32, 1, 96, "partial"),  # a value lane's W / 8 dims would cross a group
    ],
)
def test_up_to_8_rows_over_widths_64_and_128_take_the_tensor_core_kernel(
    n_q_heads, L, width, kernel
):
    """The tensor-core kernel takes the shapes its layout covers, with one
    block a (range, KV head, batch row): every query row of a KV head in it."""
    got, partial, reduce = qa._decode_launch(
        2, n_q_heads, L, width, 8, width, 8, 32, 0, False, 16, mx.bfloat16, 0.1
    )
    assert got == kernel
    rows = n_q_heads // 8 * L
    if kernel == "mma":
        assert partial["call"]["grid"] == (16 * 128, 8, 2)
        # One array of partial results: a row's outputs, maximum and sum.
        assert partial["call"]["output_shapes"] == [(2, 8, 16, rows * (width + 2))]


# Which calls reach the kernel.


def test_no_kernel_without_mlx_s_cuda_backend(monkeypatch):
    """A faked CUDA backend on a CPU build keeps the dequantizing road."""
    fake_backend(monkeypatch, "cuda")
    monkeypatch.setattr(qa, "_cuda_kernels", False)
    assert not qa.use_decode_kernel(mx.ones((1, 8, 1, 64), mx.bfloat16), 8)


def test_the_environment_can_keep_the_old_road(monkeypatch):
    monkeypatch.setattr(qa, "_cuda_kernels", True)
    q = mx.ones((1, 8, 1, 64), mx.bfloat16)
    assert qa.use_decode_kernel(q, 8) and qa.use_decode_kernel(q, 4)
    assert not qa.use_decode_kernel(q, 6)
    assert not qa.use_decode_kernel(q.astype(mx.float32), 8)
    assert not qa.use_decode_kernel(mx.ones((1, 8, 16, 64), mx.bfloat16), 8)
    assert not qa.use_decode_kernel(mx.ones((1, 8, 1, 256), mx.bfloat16), 8)
    # Read at import, as QuantizedKVCache.decode_tail reads it.
    code = "import mlx.core as mx, mlx_lm_patched; "
    code += (
        "from mlx_lm.kernels import quantized_decode as qa; qa._cuda_kernels = True; "
    )
    code += "print(qa.use_decode_kernel(mx.ones((1, 8, 1, 64), mx.bfloat16), 8))"
    env = dict(os.environ, MLX_LM_PATCHED_DECODE_KERNEL="0")
    run = [sys.executable, "-c", code]
    out = subprocess.run(run, env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False"]


@pytest.mark.parametrize("kv_bits", [4, 8])
def test_cuda_decode_steps_take_the_kernel_and_prefill_chunks_do_not(
    monkeypatch, kv_bits
):
    """On (faked) CUDA with the kernel standing in as its reference: every
    decode step and a short last prefill chunk go through it, no long chunk, and greedy tokens
    equal upstream's road (CPU, float32 llama: the real kernel takes half
    precision queries, here any)."""
    model = tiny.build_model(tiny.model_config("llama", head_dim=64))
    # 199 tokens prefilled: chunks of 64, 64, 64 and 7 (a short block)
    prompt = mx.array(np.random.default_rng(0).integers(0, 512, 200))
    kw = dict(kv_bits=kv_bits, quantized_kv_start=0, prefill_step_size=64)
    want = single_stream(model, prompt, 20, **kw)[0]

    calls = []

    def kernel(queries, q_keys, q_values, scale, mask, group_size, bits):
        calls.append(queries.shape[2])
        return decode_attention_reference(
            queries, q_keys, q_values, scale, mask, group_size, bits, 3
        )

    fake_backend(monkeypatch, "cuda")
    monkeypatch.setattr(qa, "_cuda_kernels", True)
    monkeypatch.setattr(base, "quantized_decode_attention", kernel)
    monkeypatch.setattr(
        base, "use_decode_kernel", lambda q, bits: q.shape[2] <= qa.DECODE_MAX_QUERIES
    )
    quantized_matmul = mx.quantized_matmul
    monkeypatch.setattr(mx, "quantized_matmul", None)  # CUDA's fails on a cache
    try:
        got = single_stream(model, prompt, 20, **kw)[0]
    finally:
        monkeypatch.setattr(mx, "quantized_matmul", quantized_matmul)
    assert got == want
    n_layers = len(model.layers)
    assert calls[:n_layers] == [7] * n_layers  # the short chunk
    assert set(calls[n_layers:]) == {1} and len(calls) % n_layers == 0


def test_reverting_the_patch_removes_the_kernel_from_base():
    mlx_lm_patched.revert("quantized_decode_kernel")
    assert not hasattr(base, "quantized_decode_attention")
