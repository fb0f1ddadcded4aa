"""Shared fixtures: tiny model directories and the patch state around a test.

Every test starts with the patches applied as importing ``mlx_lm_patched``
left them, and whatever it applies or reverts is undone afterwards.
"""

import json

import mlx.core as mx
import pytest

import mlx_lm_patched
from mlx_lm_patched import _apply
from mlx_lm_patched.demo import tiny


def applied_patches():
    return [p.name for p in mlx_lm_patched.PATCHES if _apply.is_applied(p.name)]


@pytest.fixture(autouse=True)
def _restore_patch_state():
    before = applied_patches()
    yield
    if applied_patches() != before:
        mlx_lm_patched.revert()
        if before:
            mlx_lm_patched.apply(*before)


@pytest.fixture
def patched():
    """All of ``PATCHES`` applied (drift is an error here); yields their names."""
    yield mlx_lm_patched.apply(strict=True)


@pytest.fixture(scope="module")
def exact_active_memory():
    """No buffer reuse: a reused larger block would count its own size."""
    limit = mx.set_cache_limit(0)
    mx.clear_cache()
    yield
    mx.set_cache_limit(limit)


@pytest.fixture
def cpu_device():
    """MLX's CPU as the default device, also on a machine with a GPU: tests
    fake the backend to pin each road, and compute on CPU."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(device)


@pytest.fixture
def upstream():
    """Plain upstream mlx-lm: every patch reverted for the test."""
    mlx_lm_patched.revert()
    yield


@pytest.fixture(scope="session")
def make_tiny_dir(tmp_path_factory):
    """``make_tiny_dir(family, **overrides) -> Path``, each built once a session."""
    made = {}

    def make(family="llama", **overrides):
        key = (family, json.dumps(overrides, sort_keys=True))
        if key not in made:
            path = tmp_path_factory.mktemp(family)
            made[key] = tiny.make_model_dir(path, family, **overrides)
        return made[key]

    return make


@pytest.fixture(scope="session")
def load_tiny(make_tiny_dir):
    """``load_tiny(family, **overrides) -> (model, tokenizer)``, loaded once a
    session: treat them as read-only."""
    from mlx_lm.utils import load

    loaded = {}

    def get(family="llama", **overrides):
        path = make_tiny_dir(family, **overrides)
        if path not in loaded:
            loaded[path] = load(str(path))
        return loaded[path]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(make_tiny_dir):
    """llama with sliding (window 64) and full layers: RotatingKVCache and KVCache."""
    return make_tiny_dir("llama_sliding")


@pytest.fixture(scope="session")
def sdist():
    """The pinned mlx-lm sdist, extracted (``tools.sdist``); without the
    package index the test skips."""
    from tools.sdist import UpstreamUnavailable, sdist_tree

    try:
        return sdist_tree()
    except UpstreamUnavailable as e:
        pytest.skip(f"package index unreachable, no mlx-lm sdist: {e}")
