"""Each patch taken away alone, reverted or set aside by a drifting release:
what stays applied keeps working (a generate call, a batch, a server
request, a cache file), or is taken away with it.

A patch must not read what another patch provides without needing it
(``_apply.requirements``: global names, class attributes, ``requires``);
a need missed here fails one of these runs with an ``AttributeError`` or a
``NameError`` (as ``BatchRotatingKVCache.nbytes`` reading
``row_checkpoints`` of ``batch_rotating_rows`` did).
"""

import argparse
import warnings

import mlx.core as mx
import pytest
from ringref import cli_args, generation_args

import mlx_lm_patched
from mlx_lm_patched import PatchDriftWarning, _apply, _registry
from mlx_lm_patched._merge import MergeConflict

NAMES = [p.name for p in mlx_lm_patched.PATCHES]
BY_NAME = {p.name: p for p in mlx_lm_patched.PATCHES}
FAMILIES = ("llama_sliding", "llama")
PROMPT = "The key and value cache holds what attention has already read. " * 4


@pytest.fixture(scope="module")
def models(make_tiny_dir):
    """Head dim 64 (upstream quantizes it): llama with sliding (window 64) and
    full layers, and llama with full layers only."""
    return [make_tiny_dir(f, head_dim=64) for f in FAMILIES]


def serve_one(model_dir):
    """One completion through the server's generation thread (a real
    ``ResponseGenerator``, as an HTTP request reaches it), rings of 32
    tokens: its tokens."""
    from mlx_lm.models.cache import LRUPromptCache
    from mlx_lm.server import CompletionRequest, ModelProvider, ResponseGenerator

    args = vars(cli_args(model_dir)) | {"max_kv_size": 32, "prompt_cache_slack": 8}
    provider = ModelProvider(argparse.Namespace(**args))
    generator = ResponseGenerator(provider, LRUPromptCache())
    try:
        request = CompletionRequest("text", PROMPT, [], None, None)
        _, responses = generator.generate(request, generation_args(3))
        assert len([r.token for r in responses]) == 3
    finally:
        generator.stop_and_join()


def cache_file(model, tmp_path):
    """A prompt cache of rings saved to a safetensors file and loaded back."""
    from mlx_lm.models.cache import (
        load_prompt_cache,
        make_prompt_cache,
        save_prompt_cache,
    )

    cache = make_prompt_cache(model, 32)
    model(mx.array([list(range(3, 80))]), cache=cache)
    path = str(tmp_path / "cache.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert [c.offset for c in loaded] == [c.offset for c in cache]
    assert sum(c.nbytes for c in cache) > 0


def steps(models, load_tiny, tmp_path):
    """The smoke set, by name: generate (a ring that wraps; 8-bit caches with
    and without rings), a batch, a server request, a cache file."""
    from mlx_lm import batch_generate, generate

    ring_model, full_model = (load_tiny(f, head_dim=64) for f in FAMILIES)
    (model, tokenizer), (full, full_tokenizer) = ring_model, full_model
    eight = {"kv_bits": 8, "quantized_kv_start": 0, "max_tokens": 3}
    prompts = [tokenizer.encode(PROMPT), tokenizer.encode(PROMPT[:40])]
    return {
        "ring": lambda: generate(
            model, tokenizer, PROMPT, max_tokens=3, max_kv_size=32
        ),
        "8-bit": lambda: generate(full, full_tokenizer, PROMPT, **eight),
        "8-bit rings": lambda: generate(model, tokenizer, PROMPT, **eight),
        "batch": lambda: batch_generate(model, tokenizer, prompts, max_tokens=3),
        "server": lambda: serve_one(models[0]),
        "cache file": lambda: cache_file(model, tmp_path),
    }


def failure(step):
    """The type of exception ``step()`` raises, or ``None``."""
    try:
        step()
    except Exception as e:
        return type(e)
    return None


@pytest.fixture(scope="module")
def upstream_fails(models, load_tiny, tmp_path_factory):
    """What each step raises on plain upstream mlx-lm (every patch reverted)."""
    mlx_lm_patched.revert()
    try:
        smoke_set = steps(models, load_tiny, tmp_path_factory.mktemp("upstream"))
        return {name: failure(step) for name, step in smoke_set.items()}
    finally:
        mlx_lm_patched.apply()


def smoke(models, load_tiny, tmp_path, upstream_fails):
    """Every step works with what is applied now, or fails as it does on
    upstream (a feature gone with the patch: 8-bit rings)."""
    got = {n: failure(s) for n, s in steps(models, load_tiny, tmp_path).items()}
    broken = {n: e for n, e in got.items() if e and e is not upstream_fails[n]}
    assert not broken, f"upstream: {upstream_fails}"


@pytest.mark.parametrize("name", NAMES)
def test_a_patch_reverted_alone_leaves_the_rest_working(
    name, models, load_tiny, tmp_path, upstream_fails
):
    mlx_lm_patched.apply(strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the ones that need it go too
        reverted = mlx_lm_patched.revert(name)
    assert reverted[0] == name
    assert set(_apply.dependents([name])) <= set(reverted)
    smoke(models, load_tiny, tmp_path, upstream_fails)


@pytest.mark.parametrize("name", NAMES)
def test_a_patch_set_aside_by_a_drifting_release_leaves_the_rest_working(
    name, models, load_tiny, tmp_path, upstream_fails, monkeypatch
):
    """One of its objects conflicts with the installed source, as when a new
    mlx-lm release changed its lines: it is set aside, with the patches
    that need it; the rest apply and work."""
    targets = BY_NAME[name].targets
    changed = next((t for t in targets if not _apply._is_helper(t)), targets[0])
    resolve = _registry.Target.resolve

    def drifted(target):
        if target.key == changed.key:
            raise MergeConflict(f"{target.name} changed by both (simulated)")
        return resolve(target)

    mlx_lm_patched.revert()
    monkeypatch.setattr(_registry.Target, "resolve", drifted)
    with pytest.warns(PatchDriftWarning, match=f"patch {name!r} not applied"):
        applied = mlx_lm_patched.apply()
    assert name not in applied
    aside = set(NAMES) - set(applied)
    for other in aside - {name}:  # set aside for what it needs or edits on top of
        needs = set(_apply.requirements(BY_NAME[other])) & provided(aside)
        assert needs or stacked_on(other, aside - {other})
    smoke(models, load_tiny, tmp_path, upstream_fails)


def stacked_on(name, names):
    """The objects patch ``name`` edits that patches ``names`` change too."""
    keys = {t.key for n in names for t in BY_NAME[n].targets}
    return {t.key for t in BY_NAME[name].targets} & keys


def provided(names):
    """The patches ``names`` and the objects they provide."""
    return set(names) | {t.name for n in names for t in BY_NAME[n].targets}
