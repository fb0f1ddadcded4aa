"""The drop-in fronts and what importing the package does, in subprocesses."""

import importlib
import json
import sys

import mlx_lm
import pytest
from ringref import python

import mlx_lm_patched
from mlx_lm_patched import tiny

PROMPT = " ".join(tiny.TEXT.split()[:60])

# Prints, per patch: applied, and whether every target holds upstream's object.
STATE = """
import importlib
import json
import mlx_lm_patched
from mlx_lm_patched import _registry

def upstream(t):
    try:
        owner = t.resolve_owner()
    except AttributeError:  # a class a patch adds, absent upstream
        return True
    if t.new is _registry.REMOVED:
        return t.attr in vars(owner)
    return getattr(owner, t.attr, None) is not t.new

print(json.dumps({
    p.name: [_registry.is_applied(p.name), all(upstream(t) for t in p.targets)]
    for p in mlx_lm_patched.PATCHES
}))
"""


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


def test_package_exports_mlx_lm_functions():
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


@pytest.mark.parametrize(
    "front", ["generate", "chat", "server", "cache_prompt", "benchmark"]
)
def test_front_takes_the_same_flags_as_upstream(front, capsys, monkeypatch):
    ours = importlib.import_module(f"mlx_lm_patched.{front}")
    theirs = importlib.import_module(f"mlx_lm.{front}")
    assert ours.main is not theirs.main
    assert help_text(ours.main, capsys, monkeypatch) == help_text(
        theirs.main, capsys, monkeypatch
    )


def test_generate_front_runs_without_warnings():
    done = python("-W", "error::RuntimeWarning", "-m", "mlx_lm_patched.generate", "-h")
    assert "RuntimeWarning" not in done.stderr


def test_demo_runs_and_finds_the_same_tokens(tiny_model_dir):
    args = ["--model", str(tiny_model_dir), "--prompt-tokens", "200"]
    args += ["--max-tokens", "40", "--prefill-step-size", "64", "--max-kv-size", "64"]
    out = python("-m", "mlx_lm_patched.demo", *args).stdout
    assert "Peak memory:" in out
    assert "reallocations, prompt, RotatingKVCache" in out
    assert "tokens identical: yes" in out


# mlx_lm_patched.tiny, the models the tests and the demo run on.


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


def test_demo_model_is_created_once(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_LM_PATCHED_HOME", str(tmp_path))
    path = tiny.demo_model_dir()
    assert path == tmp_path / "demo-model"
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert tiny.demo_model_dir() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == ["demo-model"]


def test_demo_model_is_rebuilt_when_its_config_is_stale(tmp_path):
    path = tiny.make_model_dir(tmp_path / "demo", "llama")
    assert tiny.demo_model_dir(path) == path
    config = json.loads((path / "config.json").read_text())
    assert config == tiny.model_config(tiny.DEMO_FAMILY, **tiny.DEMO_OVERRIDES)
