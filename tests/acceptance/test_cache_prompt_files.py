"""``python -m mlx_lm_patched.cache_prompt`` writes a file that
``python -m mlx_lm_patched.generate --prompt-cache-file`` continues, and the
file travels between patched and plain mlx-lm."""

import pytest
from harness import (
    LONG,
    MAX_TOKENS,
    OPTIONS,
    assert_clean_error,
    cells,
    cli,
    generate,
    ok,
    text_of,
)

MORE = " more"

CELLS = [
    ("llama", "default"),
    ("llama_sliding", "default"),
    ("gemma3_text", "default"),
    ("llama_sliding", "max-kv-128"),
    ("gemma3_text", "max-kv-48"),
    ("llama_sliding", "kv8-start0"),
    ("qwen3", "kv8-start0"),
    ("gemma3_text", "kv4-start0"),
    ("llama", "kv4-start100"),
    ("llama", "kv8-start100"),
    ("llama_sliding", "kv4-start100"),
]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("prompt-caches")


def cache_prompt(cache_dir, model_dir, model, option, upstream=False):
    """The file ``cache_prompt`` writes for ``LONG`` (once a session)."""
    name = f"{model}-{option}-{'upstream' if upstream else 'patched'}.safetensors"
    path = cache_dir / name
    args = ["--model", model_dir(model), "--prompt", LONG, "--prompt-cache-file", path]
    ok(cli("cache_prompt", *args, *OPTIONS[option], upstream=upstream))
    assert path.stat().st_size > 0
    return path


def continued(path, model_dir, model, option, upstream=False):
    """``generate`` of ``MORE`` after the prompt cache in ``path``."""
    args = ["--model", model_dir(model), "--prompt-cache-file", path]
    args += ["--prompt", MORE, "--max-tokens", MAX_TOKENS, "--temp", 0]
    return cli("generate", *args, *OPTIONS[option], upstream=upstream)


@pytest.mark.parametrize(
    "model, option",
    cells(CELLS),
)
def test_generate_continues_a_file_written_by_cache_prompt(
    cache_dir, model_dir, model, option
):
    path = cache_prompt(cache_dir, model_dir, model, option)
    assert text_of(continued(path, model_dir, model, option)).strip()


UNQUANTIZED = [(m, o) for m, o in CELLS if not o.startswith("kv")]


@pytest.mark.parametrize("model, option", cells(UNQUANTIZED))
def test_continued_file_writes_what_the_whole_prompt_writes_in_one_run(
    cache_dir, model_dir, model, option
):
    # With --kv-bits the file holds the prompt quantized, which one run's
    # prefill does not attend to: no reference there.
    path = cache_prompt(cache_dir, model_dir, model, option)
    want = generate(model_dir(model), LONG + MORE, *OPTIONS[option])
    assert text_of(continued(path, model_dir, model, option)) == text_of(want)


# Upstream works here and is right (see test_generate_cli.UPSTREAM).
BOTH = [("llama", "default"), ("gemma3_text", "default"), ("qwen3", "kv8-start0")]


@pytest.mark.parametrize("model, option", cells(BOTH))
def test_cache_prompt_then_generate_writes_what_upstream_writes(
    cache_dir, model_dir, model, option
):
    ours = cache_prompt(cache_dir, model_dir, model, option)
    theirs = cache_prompt(cache_dir, model_dir, model, option, upstream=True)
    want = text_of(continued(theirs, model_dir, model, option, upstream=True))
    assert text_of(continued(ours, model_dir, model, option)) == want


@pytest.mark.parametrize("model, option", cells(BOTH))
def test_a_file_written_by_upstream_continues_patched_as_upstream(
    cache_dir, model_dir, model, option
):
    theirs = cache_prompt(cache_dir, model_dir, model, option, upstream=True)
    want = text_of(continued(theirs, model_dir, model, option, upstream=True))
    assert text_of(continued(theirs, model_dir, model, option)) == want


@pytest.mark.parametrize(
    "model, option",
    cells(
        [("llama", "default"), ("llama_sliding", "default"), ("qwen3", "kv8-start0")]
    ),
)
def test_a_file_written_patched_continues_in_plain_mlx_lm(
    cache_dir, model_dir, model, option
):
    ours = cache_prompt(cache_dir, model_dir, model, option)
    want = text_of(continued(ours, model_dir, model, option))
    assert text_of(continued(ours, model_dir, model, option, upstream=True)) == want


def test_generate_refuses_a_file_that_is_not_a_prompt_cache_in_one_line(model_dir):
    weights = model_dir("llama") / "model.safetensors"
    args = ["--model", model_dir("llama"), "--prompt-cache-file", weights]
    done = cli("generate", *args, "--prompt", MORE, "--max-tokens", 4)
    assert done.returncode != 0 and "is not a prompt cache" in done.stderr
    assert_clean_error(done)


def test_generate_refuses_other_kv_bits_than_the_file_in_one_line(cache_dir, model_dir):
    path = cache_prompt(cache_dir, model_dir, "qwen3", "kv8-start0")
    args = ["--model", model_dir("qwen3"), "--prompt-cache-file", path]
    done = cli("generate", *args, "--prompt", MORE, "--max-tokens", 4, "--kv-bits", 4)
    assert done.returncode != 0 and "--kv-bits does not match" in done.stderr
    assert_clean_error(done)
