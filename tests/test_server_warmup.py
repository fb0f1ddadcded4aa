"""The server serves made-up tokens once at start, through the batched path
and a prompt cache of its own, so that the first requests find the kernels."""

import json
import logging
import subprocess
import sys
import time
import urllib.request
from types import SimpleNamespace

import mlx.core as mx
from ringref import cli_args, free_port


def warm_up(model, monkeypatch, caplog, prompt_cache=None, **flags):
    """``_warm_up`` of a generator serving ``model`` with ``flags`` (and
    ``prompt_cache``, else a new ``LRUPromptCache``): the cached-token
    counts of its fetches, and what it logged."""
    import mlx_lm.server as server

    fetched = []

    class Recorded(server.LRUPromptCache):
        def fetch_nearest_cache(self, key, tokens):
            cache, rest = super().fetch_nearest_cache(key, tokens)
            fetched.append(len(tokens) - len(rest))
            return cache, rest

    monkeypatch.setattr(server, "LRUPromptCache", Recorded)
    args = cli_args("tiny")
    vars(args).update(flags)
    generator = SimpleNamespace(
        model_provider=SimpleNamespace(model=model, is_batchable=True),
        cli_args=args,
        prompt_cache=server.LRUPromptCache() if prompt_cache is None else prompt_cache,
    )
    with caplog.at_level(logging.INFO):
        server.ResponseGenerator._warm_up(generator, mx.default_stream(mx.cpu))
    assert len(generator.prompt_cache) == 0  # the server's prompt cache: untouched
    return fetched, caplog.text


def test_the_warm_up_serves_a_prompt_then_hits_it_twice(
    patched, load_tiny, monkeypatch, caplog
):
    """A window plus 256 tokens: a miss, the same prompt again (all but its
    last token from the cache), then 64 tokens more (a hit that prefills)."""
    model, _ = load_tiny("gemma3_text")
    window = model.args.sliding_window
    fetched, log = warm_up(model, monkeypatch, caplog)
    n = window + 256
    assert f"Warm-up: {n} made-up tokens served" in log
    assert fetched == [0, n - 1, n - 1], fetched


def test_warmup_tokens_sets_the_length_and_zero_turns_it_off(
    patched, load_tiny, monkeypatch, caplog
):
    model, _ = load_tiny("llama")
    fetched, log = warm_up(model, monkeypatch, caplog, warmup_tokens=40)
    assert "Warm-up: 40 made-up tokens" in log and fetched[:2] == [0, 39]
    caplog.clear()
    fetched, log = warm_up(model, monkeypatch, caplog, warmup_tokens=0)
    assert fetched == [] and "Warm-up" not in log


def test_a_warm_up_that_fails_is_logged_and_returns(
    patched, load_tiny, monkeypatch, caplog
):
    model, _ = load_tiny("llama")

    class Broken(type(model)):
        def __call__(self, *args, **kwargs):
            raise RuntimeError("no kernels today")

    monkeypatch.setattr(model, "__class__", Broken)
    _, log = warm_up(model, monkeypatch, caplog, warmup_tokens=40)
    assert "Warm-up failed, serving without it" in log and "no kernels today" in log


def test_the_warm_up_measures_a_disk_read_where_none_was_measured(
    patched, load_tiny, monkeypatch, caplog, tmp_path
):
    """A restart whose disk tier never measured a restore reads an entry
    before the first request (``probe_read``), so the first hit's cost model
    knows what a read takes; a warm-up that knows it reads nothing."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.models.prompt_cache_disk import DiskLRUPromptCache, DiskPromptCache

    model, _ = load_tiny("llama")
    tokens, cache = list(range(3, 203)), make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    tier = DiskPromptCache(str(tmp_path))
    tier.put(("tiny", None, None), tokens, cache)
    tier.flush()
    tier.close()
    monkeypatch.setattr(DiskPromptCache, "read_min_bytes", 1)
    store = DiskLRUPromptCache(DiskPromptCache(str(tmp_path)))
    assert store.disk.read_rate == store.disk.read_prior
    _, log = warm_up(model, monkeypatch, caplog, store, warmup_tokens=40)
    assert "the prompt cache's disk tier read" in log
    assert store.disk.read_rate != store.disk.read_prior
    caplog.clear()
    _, log = warm_up(model, monkeypatch, caplog, store, warmup_tokens=40)
    assert "Warm-up: 40" in log and "disk tier read" not in log


def test_the_server_warms_up_before_its_first_request_which_finds_no_entry(
    make_tiny_dir,
):
    port = free_port()
    cmd = [
        sys.executable, "-m", "mlx_lm_patched.server", "--port", str(port),
        "--model", str(make_tiny_dir("llama")), "--warmup-tokens", "100",
    ]  # fmt: skip
    server = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    usage = None
    try:
        body = json.dumps({"prompt": "The warm-up", "max_tokens": 2}).encode()
        for _ in range(300):
            try:
                url = f"http://127.0.0.1:{port}/v1/completions"
                with urllib.request.urlopen(url, body, timeout=60) as r:
                    usage = json.loads(r.read())["usage"]
                break
            except OSError:
                time.sleep(0.1)
    finally:
        server.terminate()
        log = server.communicate(timeout=30)[1]
    assert usage is not None, log  # the server answered
    assert "Warm-up: 100 made-up tokens served" in log
    assert log.index("Warm-up:") < log.index("Prompt Cache: 0 sequences")
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_negative_warmup_tokens_is_a_one_line_error(make_tiny_dir):
    cmd = [
        sys.executable, "-m", "mlx_lm_patched.server", "--warmup-tokens", "-1",
        "--model", str(make_tiny_dir("llama")),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--warmup-tokens must be >= 0, got -1" in done.stderr
