"""Two ranks on 127.0.0.1 (``mlx.launch -n 2 --backend ring``) write the
greedy tokens one process writes: tensor parallel (``model.shard()``: llama,
qwen3) and pipeline (``model.model.pipeline()``: qwen2, the tiny family that
has it), float32, with the default cache, ``max_kv_size`` and ``kv_bits``.

    mlx.launch -n 2 --backend ring --python .venv/bin/python \\
        tests/acceptance/distributed_generate.py MODEL_DIR OUT tensor
"""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from distributed_generate import OPTIONS
from harness import REPORT, free_port

from mlx_lm_patched import tiny

HERE = Path(__file__).parent
LAUNCH = Path(sys.executable).parent / "mlx.launch"
RUNS = {"llama-tensor": ("llama", "tensor"), "qwen3-tensor": ("qwen3", "tensor"),
        "qwen2-pipeline": ("qwen2", "pipeline")}  # fmt: skip

# (run, option): reason. Cells listed here fail today.
XFAIL = {}


def env():
    path = os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def launch(cmd, timeout=300):
    """Run ``cmd`` in its own process group, killed whole on a timeout."""
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(),
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        out += f"\n(killed after {timeout} s)"
    return proc.returncode, out


def read(out, rank):
    path = out / f"rank{rank}.json"
    return json.loads(path.read_text()) if path.exists() else {"error": "no file"}


_runs = {}


def ran(run, model_dir, make_tiny_dir, tmp_path_factory):
    """Single process, then 2 ranks, once a session."""
    if run in _runs:
        return _runs[run]
    name, mode = RUNS[run]
    path = make_tiny_dir("qwen2", seed=1) if name == "qwen2" else model_dir(name)
    if mode == "pipeline":
        # sharded_load reads which file holds each layer from the index.
        index = {"weight_map": {k: "model.safetensors" for k in tiny_weights(path)}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index))
    single, ranks = (tmp_path_factory.mktemp(f"{run}-{n}") for n in (1, 2))
    script = [str(HERE / "distributed_generate.py"), str(path)]
    rc, log = launch([sys.executable, *script, str(single), mode])
    assert rc == 0, log
    cmd = [str(LAUNCH), "-n", "2", "--backend", "ring", "--python", sys.executable]
    cmd += ["--starting-port", str(free_port()), *script, str(ranks), mode]
    rc, log = launch(cmd)
    record = dict(single=read(single, 0), ranks=[read(ranks, r) for r in (0, 1)],
                  rc=rc, log=log, cmd=" ".join(cmd))  # fmt: skip
    REPORT.append(f"{record['cmd']}\n  exit {rc}")
    for r in [record["single"], *record["ranks"]]:
        who = "1 process" if r.get("size") == 1 else f"rank {r.get('rank')}"
        shown = {k: v[:8] for k, v in r.get("tokens", {}).items()}
        REPORT.append(f"  {who}: heads {r.get('heads')}, layers {r.get('layers')}, "
                      f"first tokens {shown} {r.get('error', '')}")  # fmt: skip
    _runs[run] = record
    return record


def tiny_weights(path):
    import mlx.core as mx

    return mx.load(str(path / "model.safetensors")).keys()


@pytest.mark.parametrize(
    "run, option",
    [
        pytest.param(
            run,
            option,
            id=f"{run}-{option}",
            marks=(
                [pytest.mark.xfail(strict=True, reason=XFAIL[run, option])]
                if (run, option) in XFAIL
                else []
            ),
        )
        for run in RUNS
        for option in OPTIONS
    ],
)
def test_two_ranks_write_the_tokens_of_one_process(
    model_dir, make_tiny_dir, tmp_path_factory, run, option
):
    record = ran(run, model_dir, make_tiny_dir, tmp_path_factory)
    assert "error" not in record["single"], record["single"]["error"]
    want = record["single"]["tokens"][option]
    assert len(set(want)) > 1, want  # a tiny model whose tokens say something
    assert record["rc"] == 0, record["log"]
    single = record["single"]
    for rank in record["ranks"]:
        assert rank.get("size") == 2, rank
        # Each rank holds half the heads (tensor) or half the layers (pipeline).
        halved = "heads" if run.endswith("tensor") else "layers"
        assert rank[halved] * 2 == single[halved], (rank, single)
        got = rank["tokens"].get(option)
        assert got == want, f"rank {rank['rank']}: {rank.get('error')}\n{record['log']}"
