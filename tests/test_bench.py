"""Smoke run of ``python -m mlx_lm_patched.bench memory`` on a tiny geometry.

Checks the JSON's keys and its counts (never its times): the counts must
follow from the geometry, and from upstream's 256-token growth on the
upstream side.
"""

import json
import statistics
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_lm_patched
from mlx_lm_patched.bench import __main__ as bench
from mlx_lm_patched.bench import memory, serve, soak

# 3 layers, ring of 300: upstream grows 40 -> 296 -> 300 during decode.
TINY = (
    "--layers 3 --heads 2 --head-dim 8 --max-size 300 --keep 4 --prefill 40 "
    "--long-prefill 700 --chunk 256 --turn 64 --decode 320 --batch 4 --device cpu"
).split()
SIDE_KEYS = {
    "reallocations",
    "reallocations_by_phase",
    "worst_transient",
    "worst_decode_transient",
    "peak",
    "prefill_peak",
    "active_end",
    "cache_nbytes_end",
    "allocator_cache_end",
    "step_ms",
}
TARGETS = {
    "zero_reallocations",
    "zero_decode_reallocations",
    "decode_transient_le_one_token",
    "prefill_peak_le_bound",
    "median_le_upstream",
    "worst_le_3x_median",
}
HEADER = ["benchmark", "device", "mlx", "mlx_lm", "patches"]
HAS_RING_PATCH = any(p.name == "rotating_prealloc" for p in mlx_lm_patched.PATCHES)


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    png = tmp_path_factory.mktemp("bench") / "memory.png"
    out = memory.main(TINY + ["--png", str(png)])
    assert png.stat().st_size > 0
    yield out
    mlx_lm_patched.apply()


def test_json_has_every_scenario_side_and_target(result):
    assert json.loads(json.dumps(result)) == result
    assert list(result)[:5] == HEADER
    assert set(result["scenarios"]) == {"a", "b", "c"}
    for r in result["scenarios"].values():
        for side in ("upstream", "patched"):
            assert SIDE_KEYS <= set(r[side])
            assert set(r[side]["step_ms"]) == {"median", "p99", "max"}
        assert TARGETS <= set(r["targets"])
        assert all(isinstance(v, bool) for v in r["targets"].values())
    assert "layerwise_prefill_peak_le_bound" in result["scenarios"]["b"]["targets"]
    assert "turn" in result["scenarios"]["b"]["patched"]


def test_every_round_counts_the_same_reallocations(result):
    for r in result["scenarios"].values():
        for side in ("upstream", "patched"):
            counts = r[side]["reallocations_by_round"]
            assert len(counts) == 2 and len(set(counts)) == 1


def test_token_bytes_follow_the_geometry(result):
    assert result["token_kv_bytes"] == 2 * 3 * 2 * 8 * 2
    assert result["scenarios"]["c"]["token_kv_bytes"] == 4 * 2 * 3 * 2 * 8 * 2


def test_upstream_grows_its_ring_in_256_token_steps(result):
    # Decode from 40 tokens: 40 -> 296 -> 300, two reallocations per layer.
    a = result["scenarios"]["a"]["upstream"]
    assert a["reallocations_by_phase"] == {"prefill": 0, "decode": 6, "turn": 0}
    assert a["worst_decode_transient"] > 0


def test_caches_end_at_the_size_the_geometry_gives(result):
    token = 2 * 3 * 2 * 8 * 2
    ends = {
        s: {
            k: v["cache_nbytes_end"]
            for k, v in r.items()
            if k in ("upstream", "patched")
        }
        for s, r in result["scenarios"].items()
    }
    assert ends["a"] == {"upstream": 300 * token, "patched": 300 * token}
    # After a 64-token turn upstream keeps max_size + 64 - 1 tokens.
    assert ends["b"]["upstream"] == (300 + 64 - 1) * token
    assert ends["c"]["upstream"] == 4 * 300 * token


@pytest.mark.skipif(
    not HAS_RING_PATCH, reason="rotating_prealloc is not in mlx_lm_patched.PATCHES yet"
)
def test_patched_ring_never_reallocates_during_decode(result):
    for s in ("a", "b"):
        r = result["scenarios"][s]["patched"]
        assert r["reallocations_by_phase"]["decode"] == 0
        assert r["worst_decode_transient"] <= result["token_kv_bytes"]
    assert result["scenarios"]["a"]["patched"]["reallocations"] == 0


def test_pointer_is_stable_across_an_in_place_update():
    a = mx.zeros((1, 2, 16, 8), mx.bfloat16)
    mx.eval(a)
    before = memory.pointer(a)
    a[..., 3:4, :] = mx.ones((1, 2, 1, 8), mx.bfloat16)
    mx.eval(a)
    assert memory.pointer(a) == before
    held = a[..., :4, :]  # a live view blocks donation: a copy, a new buffer
    a[..., 5:6, :] = mx.ones((1, 2, 1, 8), mx.bfloat16)
    mx.eval(a, held)
    assert memory.pointer(a) != before


def test_memory_method_counts_the_same_reallocations_as_pointer(capsys):
    small = TINY + ["--scenarios", "a", "--rounds", "1", "--warmup", "0"]
    by_pointer = memory.main(small + ["--realloc-method", "pointer"])
    assert "scenario a: 100%" in capsys.readouterr().err  # its progress bar
    by_memory = memory.main(small + ["--realloc-method", "memory"])
    for side in ("upstream", "patched"):
        p = by_pointer["scenarios"]["a"][side]["reallocations_by_phase"]
        m = by_memory["scenarios"]["a"][side]["reallocations_by_phase"]
        assert p == m


def test_soak_writes_to_out_the_json_it_prints(tmp_path, capsys):
    path = tmp_path / "soak.json"
    tiny = "--steps 20 --sample 10 --prefill 16 --layers 1 --heads 2 --head-dim 64 "
    tiny += f"--max-size 32 --pool 4 --out {path}"
    out = soak.main(tiny.split())
    printed = capsys.readouterr().out
    assert path.read_text() == printed
    assert json.loads(printed) == out
    assert list(out)[:5] == HEADER
    assert set(out["scenarios"]) == {"rotating", "quantized", "quantized_ring"}


def test_dispatch_knows_every_benchmark_module_and_refuses_others(capsys):
    # Modules named ``_*`` (``__init__``, ``__main__``, ``_sides``) are not benchmarks.
    modules = {p.stem for p in Path(bench.__file__).parent.glob("[!_]*.py")}
    assert set(bench.COMMANDS) == modules | {"all"}
    assert bench.main(["nonsense"]) == 2
    assert "memory, quantized, soak, prompt_cache, e2e" in capsys.readouterr().err


def test_e2e_tiny_model_runs_every_cache_and_scenario(tmp_path, capsys):
    tiny = "--layers 2 --hidden 64 --heads 4 --kv-heads 2 --intermediate 128 "
    tiny += "--vocab 100 --prompts 300 --chunk 128 --max-size 128 --decode 8 "
    tiny += "--kv-prompt 200 --kv-bits 8 --batch-prompts 90,60 --batch-new 3 "
    tiny += "--batch-max-kv 64 --rounds 1 --batch-rounds 1 --device cpu "
    tiny += "--only rotating_prealloc"
    assert bench.main(["e2e", *tiny.split(), "--out", str(tmp_path / "e2e.json")]) == 0
    # Progress: a tqdm bar per measured scenario and for the interleaved decode.
    err = capsys.readouterr().err
    for bar in ("single 300:", "decode, interleaved:", "quantized 200:", "batch:"):
        assert bar in err
    out = json.loads((tmp_path / "e2e.json").read_text())
    assert list(out)[:5] == HEADER and out["device"] == str(mx.Device(mx.cpu))
    token = 2 * 2 * 2 * 16 * 2  # K and V, layers, kv heads, head_dim, bf16
    single = out["single"]["300"]
    for side in ("upstream", "patched", "kvcache"):
        assert single[side]["decode_tokens"] == 8
    assert single["only_rotating_prealloc"]["decode_tokens"] == 8
    assert single["patched"]["cache_nbytes_end"] == 128 * token
    assert all(single["decode_interleaved_ms"][k] > 0 for k in ("upstream", "patched"))
    assert set(single["decode_interleaved_ms"]) == {"upstream", "patched", "paired"}
    ratio, low, high = single["ratios"]["patched_over_upstream_decode_ms_paired"]
    assert low <= ratio <= high
    # The unbounded cache holds all 308 tokens, in 256-token steps.
    assert single["kvcache"]["cache_nbytes_end"] == 512 * token
    assert all(isinstance(v, bool) for v in single["targets"].values())
    q = out["quantized"]
    assert "NotImplementedError" in q["upstream_rotating_q8"]["error"]
    for side in ("rotating_q8", "kvcache_q8"):
        assert q[side]["decode_tokens"] == 8
    for n in (None, 64):
        assert q[f"batch_{n}_q8"]["generated"] == q[f"batch_{n}_bf16"]["generated"]
        assert isinstance(q["targets"][f"batch_{n}_q8_prefill_peak_lt_bf16"], bool)
    for r in (out["batch"][f"max_kv_size={n}"] for n in (None, 64)):
        assert r["patched"]["generated"] == r["upstream"]["generated"] == 2 * 3
    assert out["batch"]["max_kv_size=None"]["tokens_match_upstream"]
    assert all(isinstance(v, bool) for v in out["batch"]["targets"].values())


@pytest.mark.parametrize("blocks", [None, 64])
def test_disk_bench_restores_the_prefix_and_decodes_the_same_tokens(tmp_path, blocks):
    """Whole or cut into blocks, the restored prefix decodes the tokens the
    prefilled one does; cut, it is 4 block files of 64 tokens and an entry
    file, all of which the plain reader reads."""
    from mlx_lm_patched.bench import disk

    argv = "--layers 2 --hidden 64 --heads 4 --kv-heads 2 --head-dim 16"
    argv += " --intermediate 128 --prefix 300 --question 5 --decode 6 --device cpu"
    argv += f" --blocks {blocks}" if blocks else ""
    out = disk.main(argv.split() + ["--out", str(tmp_path / "disk.json")])
    assert out["blocks"] == blocks and out["files"] == (5 if blocks else 1)
    assert json.loads((tmp_path / "disk.json").read_text()) == out
    assert list(out)[:5] == HEADER and "prompt_cache_disk" in out["patches"]
    assert out["tokens_left_to_prefill"] == 5 and out["same_tokens"]
    assert len(out["tokens"]) == 6
    # 2 layers x keys and values x 2 KV heads x 16 dims x 300 tokens, bfloat16
    assert out["file_bytes"] > 2 * 2 * 2 * 16 * 300 * 2
    # The cold read is named, the plain reader's bound and the cost model's
    # choice given: on this CPU, restoring beats a prefill.
    assert out["page_cache_drop"] in ("drop_caches", "fadvise")
    assert out["bound_s"] > 0 and out["restore_vs_bound"] > 0
    model = out["cost_model"]
    assert model["prefill_tokens_per_s"] == out["prefill_tokens_per_s"]
    assert model["choice"] == (
        "restore" if model["expected_restore_s"] < model["expected_prefill_s"]
        else "recompute"
    )  # fmt: skip


def test_disk_write_bench_writes_every_entry_it_puts(tmp_path):
    from mlx_lm_patched.bench import disk_write

    argv = "--layers 2 --kv-heads 2 --head-dim 16 --tokens 300 --repeat 3"
    out = disk_write.main(argv.split() + ["--queued", "2", "--device", "cpu"])
    assert list(out)[:5] == HEADER and "prompt_cache_disk" in out["patches"]
    # 2 layers x keys and values x 2 KV heads x 16 dims x 300 tokens, bfloat16,
    # and each layer's offset
    assert out["entry_bytes"] == 2 * 2 * 2 * 16 * 300 * 2 + 2 * 4
    assert len(out["put_ms_all"]) == 3
    assert (out["queued"], out["dropped"], out["left_unwritten"]) == (2, 0, 0)
    out = disk_write.main(argv.split() + ["--queued", "0", "--blocks", "64"])
    assert len(out["insert_ms_all"]) == len(out["insert_shared_ms_all"]) == 3
    # Each repeat: its 4 whole blocks and tail, another tail, and a whole entry
    assert out["dir_bytes"] > 3 * 2 * out["entry_bytes"]


def test_prompt_cache_bench_stores_live_tokens_with_upstream_tokens():
    from mlx_lm_patched.bench import prompt_cache

    out = prompt_cache.main("--prompts 3 --length 100 --window 64 --decode 4".split())
    assert list(out)[:5] == HEADER
    assert out["upstream"]["stored_bytes"] > out["live_bytes"]
    assert out["patched"]["stored_bytes"] == out["live_bytes"]
    assert out["patched"]["held_bytes"] == out["live_bytes"]
    assert out["without_store"]["stored_bytes"] > out["live_bytes"]
    assert out["patched"]["tokens"] == out["upstream"]["tokens"]
    assert len(out["patched"]["tokens"]) == 4


def test_prefix_blocks_bench_stores_a_shared_prefix_once():
    from mlx_lm_patched.bench import prefix_blocks

    argv = "--conversations 3 --prefix 200 --tail 20 --turn 5 --block-sizes 64"
    out = prefix_blocks.main(argv.split() + ["--repeats", "1"])
    assert list(out)[:5] == HEADER
    # 3 whole blocks of the prefix once; each its last 8 prefix tokens and 20
    assert out["blocks_64"]["stored_bytes"] * 260 == out["once_bytes"] * (192 + 84)
    assert out["blocks_64"]["held_bytes"] == out["blocks_64"]["stored_bytes"]
    assert out["whole"]["ratio"] > 2.5 and out["targets"]["same_logits"]
    # On disk: the prefix's 3 blocks are files every entry names, once
    disk = out["disk"]
    assert disk["blocks_64"]["shared_bytes"] * 260 > out["once_bytes"] * 192
    assert disk["blocks_64"]["dir_bytes"] < disk["whole"]["dir_bytes"] / 2
    assert disk["whole"]["shared_bytes"] == 0


def test_slack_bench_decodes_every_ring_in_place():
    from mlx_lm_patched.bench import slack

    small = "--layers 2 --max-size 64 --heads 2 --kv-heads 1 --head-dim 16 "
    small += "--steps 20 --rounds 1 --slack 4 --device cpu"
    result = slack.main(small.split())
    sides = [k for k in result if k.startswith(("upstream", "patched"))]
    assert sides == ["upstream", "patched_slack_0", "patched_slack_4"]
    assert all(result[k]["ring_buffers"] == 1 for k in sides)


def test_checkpoints_bench_leaves_less_to_prefill_than_upstream():
    from mlx_lm_patched.bench import checkpoints

    small = "--window 64 --first 400 --shared 300 --every 128 --rounds 1 "
    small += "--layers 1 --ring 256 --tokens 2048 --device cpu"
    out = checkpoints.main(small.split())
    assert list(out)[:5] == HEADER
    assert out["upstream"]["left_to_prefill"] == out["main"]["left_to_prefill"] == 340
    assert out["checkpoints"]["left_to_prefill"] == 340 - 256
    assert out["checkpoints"]["max_abs_logit_diff"] <= 1e-5
    assert out["checkpoints"]["bytes"] > 0 == out["main"]["bytes"]
    # Quantized at rest with their entry: about 0.53x and 0.28x of float16's
    at_rest = [out[f"stack_checkpoint_bytes_at_rest_{b}_bits"] for b in (16, 8, 4)]
    assert 0 < at_rest[2] < at_rest[1] < 0.6 * at_rest[0]


def test_quality_bench_agrees_fully_where_the_cache_is_exact(make_tiny_dir):
    """On a tiny model: the reference row agrees with itself, a ring as large
    as the sequence changes nothing, a merged batch gives each row its single
    stream's tokens, a ring smaller than the context does change some, and
    an 8-bit entry at rest (full layers or rings) leaves perplexity within 5%."""
    from mlx_lm_patched.bench import quality

    path = make_tiny_dir("llama_sliding", vocab_size=512)
    args = ["--model", str(path), "--sequences", "2", "--length", "96"]
    table = quality.main(args + ["--chunk", "32", "--rings", "96,16"])
    rows = {label: (ppl, agree) for label, ppl, agree, _ in table}
    reference = rows["bf16, unbounded (the reference)"]
    assert reference[1] == 100
    ring = rows["ring 96 (max_kv_size, keep 4)"]
    assert ring[1] == 100 and ring[0] == pytest.approx(reference[0], rel=1e-3)
    assert rows["batch of 2 (merged, left-padded) vs single"][1] == 100
    assert rows["ring 16 (max_kv_size, keep 4)"][1] < 100
    # An entry quantized at rest (8-bit) and fetched back costs little.
    at_rest = rows["prompt cache entry at rest, 8-bit (half)"]
    assert at_rest[0] == pytest.approx(reference[0], rel=0.05)
    # So does a ring's (wrapped, 16 of 48 tokens): as the bf16 ring's.
    ring_at_rest = rows["entry at rest, 8-bit, ring 16 (half)"]
    assert ring_at_rest[0] == pytest.approx(
        rows["ring 16 (max_kv_size, keep 4)"][0], rel=0.05
    )


def test_qdecode_e2e_runs_the_old_road_once_and_compares_its_tokens(tmp_path):
    """Every side but the old road's is measured ``--rounds`` times; the old
    road's once, for the tokens the others are compared with."""
    from mlx_lm_patched.bench import qdecode

    tiny = "--parts e2e --sides bf16,q8,q8_old --layers 2 --hidden 64 --heads 4 "
    tiny += "--kv-heads 2 --intermediate 128 --vocab 100 --prompts 96,80 "
    tiny += "--chunk 64 --decode 8 --rounds 2 --device cpu"
    out = qdecode.main([*tiny.split(), "--out", str(tmp_path / "q.json")])
    for n in ("96", "80"):
        row = out["e2e"][n]
        for k in ("decode_tok_s", "prefill_s"):  # each a median over its rounds
            rounds = {s: len(r[f"{k}_rounds"]) for s, r in row["sides"].items()}
            assert rounds == {"bf16": 2, "q8": 2, "q8_old": 1}
            for r in row["sides"].values():
                assert r[k] == pytest.approx(statistics.median(r[f"{k}_rounds"]))
        assert row["ratios"]["q8_tokens_equal_old_road"] is True
        assert row["targets"]["q8"]["tokens_equal_old_road"] is True
        # Paired turn by turn: bfloat16's seconds over q8's, each turn (7
        # tokens: one a round), their median; the old road, alone, unpaired.
        turns = [sum(row["sides"][s]["turns_s_rounds"], []) for s in ("bf16", "q8")]
        assert len(turns[0]) == len(turns[1]) == 2
        paired = statistics.median(b / q for b, q in zip(*turns))
        assert row["ratios"]["q8_over_bf16_decode_paired"] == round(paired, 3)
        assert "q8_old_over_bf16_decode_paired" not in row["ratios"]
        # A prefill (its first round's) split into its 64-token chunks, the
        # rest but one token, and the first token's step: they add up to it.
        for r in row["sides"].values():
            assert len(r["prefill_chunks_s"]) == 3
            total = pytest.approx(r["prefill_s_rounds"][0], abs=1e-3)
            assert sum(r["prefill_chunks_s"]) == total
    assert not (tmp_path / "q.json.partial").exists()  # every round done


def test_qdecode_e2e_sides_take_turns_and_a_cut_off_keeps_finished_rounds(
    tmp_path, monkeypatch
):
    """The sides' processes prefill a prompt each, then decode in turns of
    ``--segment`` tokens, each turn the other way round, every other round
    starting from the other end; a run stopped in its second round (here:
    its next request refused) leaves the first round's summary in
    ``<out>.partial`` and no side's process behind."""
    from mlx_lm_patched.bench import _qdecode_e2e, qdecode

    ask, asked, procs = _qdecode_e2e._ask, [], set()

    def refuse_the_second_round(proc, request):
        asked.append((proc.args[proc.args.index("--side") + 1], *request.items()))
        procs.add(proc)
        if len(asked) > 20:
            raise RuntimeError("cut off")
        return ask(proc, request)

    monkeypatch.setattr(_qdecode_e2e, "_ask", refuse_the_second_round)
    tiny = "--parts e2e --sides bf16,q8 --layers 2 --hidden 64 --heads 4 "
    tiny += "--kv-heads 2 --intermediate 128 --vocab 100 --prompts 96,80 "
    tiny += "--chunk 64 --decode 8 --segment 3 --rounds 3 --device cpu"
    with pytest.raises(RuntimeError, match="cut off"):
        qdecode.main([*tiny.split(), "--out", str(tmp_path / "q.json")])
    kept = json.loads((tmp_path / "q.json.partial").read_text())
    assert kept["rounds_done"] == 1
    for n in ("96", "80"):
        sides = kept["e2e"][n]["sides"]
        assert set(sides) == {"bf16", "q8"} and sides["q8"]["decode_tok_s"] > 0
        assert "q8_over_bf16_decode_tok_s" in kept["e2e"][n]["ratios"]
    b, q = "bf16", "q8"
    # 7 tokens after the prefill's: turns of 3, 3 and 1, each the other way.
    turns = [(b, 3), (q, 3), (q, 3), (b, 3), (b, 1), (q, 1)]
    assert asked[:10] == [
        (b, ("prompt", 96)),
        (q, ("prompt", 96)),
        *((side, ("decode", k)) for side, k in turns),
        (q, ("end", True)),
        (b, ("end", True)),
    ]
    assert [a[1] for a in asked[10:12]] == [("prompt", 80)] * 2
    assert asked[20] == (q, ("prompt", 96))  # the second round, the other end
    assert len(procs) == 2  # one process a side, for every round
    assert all(p.poll() is not None for p in procs)


def test_qdecode_e2e_fresh_starts_every_round_in_new_processes(monkeypatch):
    """With ``--fresh`` each round's sides run in processes of their own,
    the last round's ended before the next starts; every round measured."""
    from mlx_lm_patched.bench import _qdecode_e2e, qdecode

    start, started = _qdecode_e2e._start_side, []

    def counted(args, side):
        started.append(start(args, side))
        return started[-1]

    monkeypatch.setattr(_qdecode_e2e, "_start_side", counted)
    tiny = "--parts e2e --sides bf16,q8 --layers 2 --hidden 64 --heads 4 "
    tiny += "--kv-heads 2 --intermediate 128 --vocab 100 --prompts 96 "
    tiny += "--chunk 64 --decode 8 --rounds 3 --fresh --device cpu"
    counted_per_round = []
    ask = _qdecode_e2e._ask

    def track(proc, request):
        if "prompt" in request:
            counted_per_round.append(len(started))
            # The last round's processes ended: only this round's run.
            assert sum(p.poll() is None for p in started) == 2
        return ask(proc, request)

    monkeypatch.setattr(_qdecode_e2e, "_ask", track)
    sides = qdecode.main(tiny.split())["e2e"]["96"]["sides"]
    assert counted_per_round == [2, 2, 4, 4, 6, 6]
    assert all(p.poll() is not None for p in started)
    assert {s: len(r["decode_tok_s_rounds"]) for s, r in sides.items()} == {
        "bf16": 3,
        "q8": 3,
    }


def test_qdecode_e2e_a_side_whose_process_dies_is_reported_the_others_run(
    monkeypatch,
):
    """A side's process gone (killed here) gives that side an error at every
    length; the other sides are measured and compared without it."""
    from mlx_lm_patched.bench import _qdecode_e2e, qdecode

    start = _qdecode_e2e._start_side

    def kill_q8(args, side):
        proc = start(args, side)
        if side == "q8":
            proc.kill()
        return proc

    monkeypatch.setattr(_qdecode_e2e, "_start_side", kill_q8)
    tiny = "--parts e2e --sides bf16,q8,q4 --layers 2 --hidden 64 --heads 4 "
    tiny += "--kv-heads 2 --intermediate 128 --vocab 100 --prompts 96,80 "
    tiny += "--chunk 64 --decode 8 --rounds 2 --device cpu"
    out = qdecode.main(tiny.split())["e2e"]
    for n in ("96", "80"):
        assert set(out[n]["sides"]["q8"]) == {"error"}
        assert out[n]["sides"]["q4"]["decode_tok_s_rounds"][1] > 0
        ratios = out[n]["ratios"]
        assert ratios["q4_over_bf16_decode_tok_s"] > 0
        assert not any(k.startswith("q8") for k in ratios)


def test_qdecode_memory_decodes_the_same_tokens_pipelined_and_synced():
    """Each side's decode memory part: pipelined steps (as generate_step
    runs them) and synced steps give the same greedy tokens, and every
    figure is measured (peaks above the start, tokens/s, the cache's bytes)."""
    from mlx_lm_patched.bench import qdecode

    tiny = "--parts memory --sides bf16,q8,q4 --layers 2 --hidden 64 --heads 4 "
    tiny += "--kv-heads 2 --intermediate 128 --vocab 100 --prompts 96 --chunk 64 "
    tiny += "--steps 6 --device cpu"
    row = qdecode.main(tiny.split())["memory"]["96"]
    assert set(row) == {"bf16", "q8", "q4"}
    for fig in row.values():
        assert fig.pop("same_tokens") is True
        assert all(fig[f"{w}_tok_s"] > 0 for w in ("pipelined", "synced"))
        assert all(v >= 0 for v in fig.values()) and fig["cache_nbytes"] > 0
    assert row["q4"]["cache_nbytes"] < row["q8"]["cache_nbytes"]


def test_qdecode_host_times_every_side_in_one_process(monkeypatch):
    """Each side's step build, launch, whole and wait after its launch (ms),
    and its first layer's update and attention call (us): every figure
    measured, none zero but the wait; the CUDA graph settings kept; each
    attention call timed over an update of its own (a decode step's call:
    over one fetch, the second call on would not be the cache's)."""
    from mlx_lm.models import base

    from mlx_lm_patched.bench import qdecode

    attention, seen = base.scaled_dot_product_attention, []

    def spy(queries, keys, *args, **kwargs):
        seen.append(keys)  # held: ids stay unique
        return attention(queries, keys, *args, **kwargs)

    monkeypatch.setattr(base, "scaled_dot_product_attention", spy)
    tiny = "--parts host --sides bf16,q8,q4,q8_old --layers 2 --hidden 64 "
    tiny += "--heads 4 --kv-heads 2 --intermediate 128 --vocab 100 --prompts 96 "
    tiny += "--chunk 64 --steps 4 --device cpu"
    out = qdecode.main(tiny.split())["host"]
    assert set(out["env"]) == {"MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER"}
    row = out["96"]
    assert set(row) == {"bf16", "q8", "q4"}  # the old road needs its own process
    keys = {"build_ms", "launch_ms", "synced_ms", "update_us", "attention_us"}
    for side in row.values():
        assert set(side) == keys | {"after_ms"} and side.pop("after_ms") >= 0
        assert all(v > 0 for v in side.values())
        assert side["synced_ms"] >= side["build_ms"]
    assert len(seen) >= 3 * 2 and len({id(k) for k in seen}) == len(seen)


def test_serve_bench_times_every_scenario_and_side_over_http(tmp_path):
    sides = ["upstream", "patched", "patched-dir"]
    argv = "--shape tiny --scale 0.03 --reply 8 --turns 3 --shared-requests 3 "
    argv += "--concurrent 3 --concurrent-turns 2 --reuse --breakdown --settle 0.3 "
    argv += "--warmup "
    argv += f"--sides {','.join(sides)} --logs {tmp_path} --out {tmp_path / 'o.json'}"
    out = serve.main(argv.split())
    assert json.loads((tmp_path / "o.json").read_text()) == out
    assert list(out)[:5] == HEADER and out["endpoint"] == "chat"
    # Each side's warm-up server answered before the runs
    warm = out["warmup_ttft_s"]
    assert list(warm) == sides and all(
        isinstance(t, float) and t > 0 for t in warm.values()
    )
    assert set(out["scenarios"]) == set(serve.SCENARIOS)
    for name, by_side in out["scenarios"].items():
        assert list(by_side) == sides
        for side, r in by_side.items():
            if name == "restart" and side != "patched-dir":
                assert r == {"skipped": "no --prompt-cache-dir"}
                continue
            assert "error" not in r, (name, side, r)
            ttft = [r[k] for k in r if k.startswith("ttft_")]  # agent: a list too
            ttft = [t for v in ttft for t in (v if isinstance(v, list) else [v])]
            assert ttft and all(t > 0 for t in ttft), (name, side, r)
            # The breakdown of the requests the scenario's TTFT is of, alone
            if side != "upstream" and name in ("agent", "repeated", "shared", "edited"):
                assert "first_token" in r["hits_timing_ms"], (name, side, r)
        # Every side was sent the same prompts.
        counts = {
            r.get("prompt_tokens") for r in by_side.values() if "skipped" not in r
        }
        assert len(counts) == 1 and counts.pop() > 0
    # After SIGTERM and after kill -9 a new process served all but the last
    # token of the prompt: from the disk; each had answered a short prompt
    # first (the model's load).
    restart = out["scenarios"]["restart"]["patched-dir"]
    whole = restart["prompt_tokens"] - 1
    assert restart["cached_sigterm"] >= whole and restart["cached_kill9"] >= whole
    assert restart["tiers"]["disk hit"] >= 2 and len(restart["ttft_load_s"]) == 3
    assert out["scenarios"]["concurrent"]["patched"]["prompt_cache_bytes"] > 0
    # --breakdown: every side at DEBUG (upstream's logs each token's text
    # there, which slows decode), not only the sides it reads timings of
    assert " - DEBUG - " in (tmp_path / "upstream-run0.log").read_text()


def test_serve_bench_waits_for_the_disk_tier_s_queue_not_only_a_quiet_directory(
    tmp_path,
):
    """Before a kill -9 the restart scenario waits until the server's log
    says nothing is left queued: a large entry's copy to host kept the
    directory unchanged for longer than ``--settle`` while it was still to
    be written (an H200 run lost it)."""
    from mlx_lm_patched.bench._serve import Server, snapshot, wait_written

    before = snapshot(tmp_path)
    (tmp_path / "a.safetensors").write_bytes(b"x")
    log = tmp_path / "server.log"
    log.write_text("INFO - Prompt cache: wrote an entry (1 B), 1 queued\n")
    server = Server("front", "model", [], log)
    assert not wait_written(tmp_path, before, 0.05, timeout=0.3, server=server)
    with open(log, "a") as f:
        f.write("INFO - Prompt cache: wrote an entry (2 B), 0 queued\n")
    assert wait_written(tmp_path, before, 0.05, timeout=0.3, server=server)
    # Only what the log says after the mark counts.
    log.write_text("INFO - Prompt cache: wrote an entry (1 B), 1 queued\n")
    mark = server.mark()
    assert wait_written(tmp_path, before, 0.05, timeout=0.3, server=server, mark=mark)


def test_serve_bench_reads_both_servers_logs_and_takes_medians_of_runs():
    from mlx_lm_patched.bench._serve import log_figures, merge

    log = (
        "INFO - Prompt Cache: 2 sequences, 1.50 GB\n"  # upstream's
        "INFO - Prompt Cache: 3 sequences, 0.00 GB (2189312 B)\n"  # ours
        "INFO - Prompt cache disk hit: 700 of 735 tokens\n"
        "DEBUG - prompt-cache timing: tokenize=0.5ms lookup=1.25ms prefill=30ms\n"
        "DEBUG - prompt-cache timing: tokenize=1.5ms lookup=0.75ms prefill=10ms\n"
        "INFO - Prompt cache at rest: 3 sequences, 0.00 GB (1189312 B)\n"  # idle
    )
    figures = log_figures(log)
    assert figures["prompt_cache_bytes"] == 1189312
    assert figures["prompt_cache_bytes_max"] == 1_500_000_000
    assert figures["tiers"] == {"disk hit": 1}
    assert figures["timing_ms"]["lookup"] == [1.25, 0.75]
    runs = [
        {"ttft_s": 1.0, "ttft": [1.0, 4.0], **figures},
        {"ttft_s": 3.0, "ttft": [2.0, 6.0], "timing_ms": {"lookup": [2.0]}},
        {"error": "RuntimeError: the server died"},
    ]
    merged = merge(runs)
    assert merged["ttft_s"] == 2.0 and merged["ttft"] == [1.5, 5.0]
    assert merged["timing_ms"] == {"tokenize": 1.0, "lookup": 1.25, "prefill": 20.0}
    assert merged["failed_runs"] == ["RuntimeError: the server died"]
    assert merged["per_run"] == runs and "per_run" not in merged["tiers"]
