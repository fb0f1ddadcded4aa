"""server_readiness: /health is 503 until the default model is loaded and
warmed up (upstream: 200 while the model still loads)."""

import threading
import time

import pytest
from ringref import cli_args

import mlx_lm_patched


@pytest.mark.parametrize("patch", [True, False])
def test_the_server_is_healthy_only_once_its_model_is_loaded_and_warmed_up(
    patched, make_tiny_dir, patch
):
    """While the default model's load is held, and during the warm-up,
    ``is_healthy`` (what ``/health`` answers) is False; then True.
    Upstream's is True throughout."""
    from mlx_lm.models.cache import LRUPromptCache
    from mlx_lm.server import ModelProvider, ResponseGenerator

    if not patch:
        mlx_lm_patched.revert("server_readiness")
    provider, release, during_warm_up = (
        ModelProvider(cli_args(make_tiny_dir("llama"))),
        threading.Event(),
        [],
    )
    load = provider.load_default

    def held():
        release.wait(60)
        load()

    provider.load_default = held

    class Watched(ResponseGenerator):
        def _warm_up(self, stream):
            during_warm_up.append(self.is_healthy)
            super()._warm_up(stream)

    generator = Watched(provider, LRUPromptCache())
    try:
        while_loading = generator.is_healthy
        release.set()
        deadline = time.monotonic() + 60
        while not generator.is_healthy and time.monotonic() < deadline:
            time.sleep(0.01)
        after = generator.is_healthy
    finally:
        release.set()
        generator.stop_and_join()
    assert (while_loading, during_warm_up, after) == (
        (False, [False], True) if patch else (True, [True], True)
    )
