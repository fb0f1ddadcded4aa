"""The drop-in fronts and what importing the package does, in subprocesses."""

import importlib
import json
import re
import shlex
import subprocess
import sys

import mlx_lm
import pytest
from ringref import python

import mlx_lm_patched
from mlx_lm_patched.demo import tiny, tiny_train

PROMPT = " ".join(tiny.TEXT.split()[:60])

# Prints, per patch: applied, and whether every target holds upstream's object.
STATE = """
import importlib
import json
import mlx_lm_patched
from mlx_lm_patched import _apply, _registry

def upstream(t):
    try:
        owner = t.resolve_owner()
    except AttributeError:  # a class a patch adds, absent upstream
        return True
    if t.new is _registry.REMOVED:
        return t.attr in vars(owner)
    return getattr(owner, t.attr, None) is not _registry._installed.get(t.key, t.new)

print(json.dumps({
    p.name: [_apply.is_applied(p.name), all(upstream(t) for t in p.targets)]
    for p in mlx_lm_patched.PATCHES
}))
"""


def run_python(*args):
    """``python *args`` in a subprocess, whatever its exit status."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True)


def generated_text(stdout):
    """The text between mlx-lm's two ``==========`` lines."""
    parts = stdout.split("==========\n")
    assert len(parts) == 3, stdout
    return parts[1]


def test_import_with_apply_0_leaves_mlx_lm_unpatched():
    out = python("-c", STATE, env={"MLX_LM_PATCHED_APPLY": "0"}).stdout
    state = json.loads(out)
    assert set(state) == {p.name for p in mlx_lm_patched.PATCHES}
    assert all(s == [False, True] for s in state.values()), state


def test_import_applies_every_patch():
    state = json.loads(python("-c", STATE, env={"MLX_LM_PATCHED_APPLY": "1"}).stdout)
    assert all(s == [True, False] for s in state.values()), state


def test_package_exports_mlx_lm_functions_as_the_patches_leave_them():
    mlx_lm_patched.revert()
    mlx_lm_patched.apply()  # builds the edited stream_generate anew
    from mlx_lm_patched import batch_generate, generate, load, stream_generate

    assert load is mlx_lm.load
    assert generate is mlx_lm.generate
    assert stream_generate is mlx_lm.stream_generate
    assert batch_generate is mlx_lm.batch_generate
    assert mlx_lm_patched.generate is mlx_lm.generate


def test_generate_front_prints_text_and_statistics(tiny_model_dir):
    args = ["--model", str(tiny_model_dir), "--prompt", PROMPT, "--max-tokens", "20"]
    out = python("-m", "mlx_lm_patched.generate", *args).stdout
    assert generated_text(out).strip()
    stats = out.split("==========\n")[2].splitlines()
    for label in ("Prompt:", "Generation:", "Peak memory:"):
        assert any(line.startswith(label) for line in stats), out
    assert "Generation: 20 tokens" in out


def test_generate_front_writes_the_same_text_as_upstream(tiny_model_dir):
    # 150 tokens through a sliding window of 64: the ring wraps.
    args = ["--model", str(tiny_model_dir), "--prompt", PROMPT, "--max-tokens", "150"]
    ours = python("-m", "mlx_lm_patched.generate", *args).stdout
    theirs = python("-m", "mlx_lm.generate", *args).stdout
    assert generated_text(ours) == generated_text(theirs)


def help_text(main, capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["front", "--help"])
    with pytest.raises(SystemExit):
        main()
    return capsys.readouterr().out


def flags(help_text):
    """The option strings a ``--help`` text lists."""
    return sorted(set(re.findall(r"(?<![\w-])--?[a-z][\w-]*", help_text)))


@pytest.mark.parametrize(
    "front", ["generate", "chat", "server", "cache_prompt", "benchmark"]
)
def test_front_takes_the_same_flags_as_upstream(front, capsys, monkeypatch):
    ours = importlib.import_module(f"mlx_lm_patched.{front}")
    theirs = importlib.import_module(f"mlx_lm.{front}")
    assert ours.main is not theirs.main
    ours_help = help_text(ours.main, capsys, monkeypatch)
    assert ours_help.startswith(f"usage: mlx_lm_patched.{front} ")
    assert flags(ours_help) == flags(help_text(theirs.main, capsys, monkeypatch))


def test_server_help_says_kv_bits_keeps_batching(capsys, monkeypatch):
    from mlx_lm_patched import server

    text = " ".join(help_text(server.main, capsys, monkeypatch).split())
    kv_bits = text[text.rindex("--kv-bits KV_BITS") : text.rindex("--kv-group-size")]
    assert "requests are still batched" in kv_bits
    assert "one at a time" not in kv_bits


def test_argument_errors_name_the_patched_program():
    done = run_python("-m", "mlx_lm_patched.generate", "--max-tokens", "many")
    assert done.returncode == 2
    assert "mlx_lm_patched.generate: error: argument --max-tokens" in done.stderr


def test_missing_prompt_cache_file_is_one_line(tiny_model_dir, tmp_path):
    missing = tmp_path / "nothing.safetensors"
    args = ["--model", str(tiny_model_dir), "--prompt-cache-file", str(missing)]
    done = run_python("-m", "mlx_lm_patched.generate", *args)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"mlx_lm_patched.generate: error: --prompt-cache-file {missing}: no such file"
    ]


def test_missing_model_directory_is_one_line(tmp_path):
    missing = tmp_path / "model"
    args = ["--model", str(missing), "--prompt", "hi"]
    done = run_python("-m", "mlx_lm_patched.generate", *args)
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        f"mlx_lm_patched.generate: error: --model {missing}: no such directory"
    ]


def test_kv_bits_below_quantized_kv_start_gives_one_notice(tiny_model_dir):
    args = ["--model", str(tiny_model_dir), "--prompt", PROMPT, "--max-tokens", "5"]
    done = python("-m", "mlx_lm_patched.generate", *args, "--kv-bits", "8")
    assert done.stderr.count("note: --kv-bits quantizes a cache once it holds") == 1
    start = ["--quantized-kv-start", "0"]
    done = python("-m", "mlx_lm_patched.generate", *args, "--kv-bits", "8", *start)
    assert "note:" not in done.stderr


def test_bounded_run_warns_in_one_line_without_source(tiny_model_dir):
    args = ["--model", str(tiny_model_dir), "--prompt", PROMPT, "--max-tokens", "5"]
    done = python("-m", "mlx_lm_patched.generate", *args, "--max-kv-size", "32")
    warned = [l for l in done.stderr.splitlines() if "max_kv_size=32" in l]
    assert len(warned) == 1
    assert warned[0].startswith("UserWarning: mlx_lm_patched: max_kv_size=32 bounds")
    assert "make_prompt_cache(" not in done.stderr


def test_importing_leaves_the_warning_hooks_of_the_process_alone():
    """Only the fronts show this package's warnings in one line (while they
    run); importing it changes no process-wide hook."""
    code = (
        "import warnings; hooks = warnings.formatwarning, warnings.showwarning; "
        "import mlx_lm_patched; "
        "assert (warnings.formatwarning, warnings.showwarning) == hooks"
    )
    assert python("-c", code).returncode == 0


def test_status_command_prints_a_table():
    done = python("-m", "mlx_lm_patched", "status")
    lines = done.stdout.splitlines()
    assert lines[0].startswith("mlx-lm-patched ")
    for p in mlx_lm_patched.PATCHES:
        assert any(l.split()[:2] == [p.name, "applied"] for l in lines), done.stdout
    assert (
        lines[-1]
        == f"{len(mlx_lm_patched.PATCHES)} of {len(mlx_lm_patched.PATCHES)} patches applied"
    )


def test_generate_front_runs_without_warnings():
    done = python("-W", "error::RuntimeWarning", "-m", "mlx_lm_patched.generate", "-h")
    assert "RuntimeWarning" not in done.stderr


def test_demo_runs_and_finds_the_same_tokens(tiny_model_dir):
    """The demo finds the same tokens, and counts reallocations by shape
    while prefilling: the patched ring none, upstream's growing ring some,
    and the chunks past the full ring said, not counted."""
    args = ["--model", str(tiny_model_dir), "--prompt-tokens", "100"]
    args += ["--max-tokens", "40", "--prefill-step-size", "16", "--max-kv-size", "48"]
    out = python("-m", "mlx_lm_patched.demo", *args).stdout
    lines = out.splitlines()
    # Both sides decode with the same repetition penalty, and the demo says so.
    assert lines[0] == (
        "mlx-lm-patched demo: greedy, repetition penalty 1.2; "
        "patched next to upstream mlx-lm"
    )
    assert lines[1].startswith("- the model's own caches: the same 40 tokens")
    assert "Generation: 40 tokens" in out
    assert "identical (40 of 40)" in out
    counts = {
        line[:38].strip(): [int(n) for n in line[38:].split()]
        for line in lines
        if line.startswith("reallocations, ")
    }
    upstream, patched, _, _ = counts["reallocations, prompt, RotatingKVCache"]
    assert patched == 0 < upstream
    assert counts["reallocations, decode, RotatingKVCache"][1] == 0
    assert re.search(r"Not counted: [1-9]\d* of the prompt's chunks", out)


def test_demo_shows_only_steady_figures_and_a_next_command_that_runs(tiny_model_dir):
    """Cache bytes and reallocations, not peak memory (it moves from run to
    run by more than the difference at this size); the bounded cache ends
    smaller than upstream's; the command it suggests runs as printed."""
    args = ["--model", str(tiny_model_dir), "--prompt-tokens", "100"]
    args += ["--max-tokens", "24", "--prefill-step-size", "16", "--max-kv-size", "48"]
    lines = python("-m", "mlx_lm_patched.demo", *args).stdout.splitlines()
    assert not [l for l in lines if l.startswith("peak memory")]
    kib = {
        l[:38].strip(): [int(n) for n in re.findall(r"(\d+) KiB", l)]
        for l in lines
        if l.startswith("cache bytes")
    }
    own_up, own_patched, bounded_up, bounded = kib["cache bytes at the end"]
    assert own_up == own_patched and bounded < bounded_up
    assert kib["cache bytes after the prompt"][3] == bounded
    suggested = lines[lines.index(next(l for l in lines if l.startswith("Next,"))) + 1]
    cmd = shlex.split(suggested)
    assert cmd[:3] == ["python", "-m", "mlx_lm_patched.generate"]
    done = python(*cmd[1:], "--max-tokens", "8")
    assert "Generation: 8 tokens" in done.stdout


# mlx_lm_patched.demo.tiny, the models the tests and the demo run on.


@pytest.mark.parametrize(
    "family, caches",
    [
        ("llama", {"KVCache"}),
        ("llama_sliding", {"RotatingKVCache", "KVCache"}),
        ("qwen3", {"KVCache"}),
        ("gemma3_text", {"RotatingKVCache", "KVCache"}),
    ],
)
def test_tiny_family_loads_through_mlx_lm_with_its_caches(family, caches, load_tiny):
    from mlx_lm.models.cache import make_prompt_cache

    model, tokenizer = load_tiny(family)
    assert model.model_type == family.split("_sliding")[0]
    assert {type(c).__name__ for c in make_prompt_cache(model)} == caches
    text = mlx_lm.generate(model, tokenizer, PROMPT, max_tokens=5)
    assert isinstance(text, str)


def test_tiny_weights_depend_only_on_the_seed(tmp_path):
    import mlx.core as mx

    a = mx.load(str(tiny.make_model_dir(tmp_path / "a", "qwen3") / "model.safetensors"))
    b = mx.load(str(tiny.make_model_dir(tmp_path / "b", "qwen3") / "model.safetensors"))
    c = tiny.make_model_dir(tmp_path / "c", "qwen3", seed=1)
    c = mx.load(str(c / "model.safetensors"))
    assert a.keys() == b.keys() == c.keys()
    assert all(mx.array_equal(a[k], b[k]) for k in a)
    assert not all(mx.array_equal(a[k], c[k]) for k in a)


def test_tiny_dtype_and_overrides_reach_the_model(tmp_path):
    import mlx.core as mx
    from mlx_lm.utils import load

    path = tiny.make_model_dir(tmp_path, "llama", dtype="bfloat16", num_hidden_layers=2)
    model, _ = load(str(path))
    assert len(model.layers) == 2
    assert model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16


def test_tiny_tokenizer_has_eos_and_a_chat_template(load_tiny):
    _, tokenizer = load_tiny("llama")
    assert tokenizer.vocab_size == tiny.VOCAB_SIZE
    assert tokenizer.eos_token == tiny.EOS_TOKEN
    assert tokenizer.eos_token_id in tokenizer.eos_token_ids
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(tokenizer.encode(PROMPT)) == PROMPT


# A recipe of a few steps: what is tested is the caching, not the training.
QUICK = {**tiny_train.RECIPE, "steps": 2, "batch": 1, "length": 16}


def test_demo_model_is_trained_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_LM_PATCHED_HOME", str(tmp_path))
    monkeypatch.setattr(tiny_train, "RECIPE", QUICK)
    path = tiny_train.demo_model_dir()
    assert path.parent == tmp_path and path.name.startswith("demo-model-")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny_train.demo_model_dir() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_demo_model_command_prints_only_the_trained_models_path(
    tmp_path, monkeypatch, capfd
):
    """``python -m mlx_lm_patched demo-model``: stdout is the path alone, so
    ``MODEL=$(python -m mlx_lm_patched demo-model)`` works, trained or not."""
    from mlx_lm_patched import __main__ as cli

    monkeypatch.setenv("MLX_LM_PATCHED_HOME", str(tmp_path))
    monkeypatch.setattr(tiny_train, "RECIPE", QUICK)
    for _ in range(2):  # trained, then found
        assert cli.main(["demo-model"]) == 0
        out = capfd.readouterr().out
        assert out == f"{tiny_train.demo_model_dir()}\n"
        assert (tmp_path / out.strip() / "config.json").exists()
    assert cli.main(["demo-modle"]) == 2


def test_a_model_from_another_trainer_is_never_used(tmp_path, monkeypatch):
    """The default directory is named by the trainer's stamp: another
    trainer's source, recipe or library versions get their own model, and
    the one already there is left as it was."""
    monkeypatch.setenv("MLX_LM_PATCHED_HOME", str(tmp_path))
    monkeypatch.setattr(tiny_train, "RECIPE", QUICK)
    old = tiny_train.demo_model_dir()
    made = (old / "model.safetensors").stat().st_mtime_ns
    stamp = tiny_train.stamp()
    newer = {**stamp, "trainer": "0" * 64}
    monkeypatch.setattr(tiny_train, "stamp", lambda: newer)
    path = tiny_train.demo_model_dir()
    assert path != old and path.parent == tmp_path
    assert json.loads((path / "training.json").read_text()) == newer
    assert json.loads((old / "training.json").read_text()) == stamp
    assert (old / "model.safetensors").stat().st_mtime_ns == made


def test_demo_model_is_retrained_when_its_config_or_recipe_is_stale(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(tiny_train, "RECIPE", QUICK)
    path = tiny.make_model_dir(tmp_path / "demo", "llama")
    assert tiny_train.demo_model_dir(path) == path
    config = json.loads((path / "config.json").read_text())
    assert config == tiny_train.CONFIG
    monkeypatch.setattr(tiny_train, "RECIPE", {**QUICK, "seed": 1})
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny_train.demo_model_dir(path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns != stamp


def test_training_gradients_are_mlx_lm_llamas(load_tiny):
    """The numpy backward pass the demo model is trained with gives the
    gradients ``mx.grad`` takes through mlx-lm's own llama."""
    import mlx.core as mx
    import mlx.nn as nn
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.models import llama

    config = {**tiny_train.CONFIG, "vocab_size": 50, "sliding_window": 5}
    rng = np.random.default_rng(1)
    params = tiny_train.init_params(config, rng)
    inputs, targets = rng.integers(0, 50, (2, 12)), rng.integers(0, 50, (2, 12))
    loss, grads = tiny_train.loss_and_grads(dict(params), config, inputs, targets)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.load_weights([(k, mx.array(v)) for k, v in params.items()])

    def mlx_loss(model, x, y):
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    ref, ref_grads = nn.value_and_grad(model, mlx_loss)(
        model, mx.array(inputs), mx.array(targets)
    )
    assert abs(loss - ref.item()) < 1e-5
    ref_grads = dict(tree_flatten(ref_grads))
    assert ref_grads.keys() == grads.keys()
    for k, g in grads.items():
        assert np.allclose(np.array(ref_grads[k]), g, rtol=1e-3, atol=1e-6), k
