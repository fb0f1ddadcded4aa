"""The server batches requests with --kv-bits and hands it to BatchGenerator."""

import inspect
import json
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from types import SimpleNamespace

from ringref import free_port


def test_server_keeps_batching_with_kv_bits(patched):
    from mlx_lm.server import ResponseGenerator

    provider = SimpleNamespace(is_batchable=True, cli_args=SimpleNamespace(kv_bits=8))
    server = SimpleNamespace(model_provider=provider)
    assert ResponseGenerator._is_batchable(server, SimpleNamespace(seed=None))
    # The batch generator the server makes is given its KV quantization.
    source = inspect.getsource(ResponseGenerator._generate)
    call = source[source.index("BatchGenerator(") :]
    call = call[: call.index("\n" + " " * 20 + ")")]  # the call's closing line
    for arg in ("kv_bits", "kv_group_size", "quantized_kv_start"):
        assert f"{arg}=self.cli_args.{arg}," in call


def test_upstream_server_serves_kv_bits_one_at_a_time(upstream):
    from mlx_lm.server import ResponseGenerator

    provider = SimpleNamespace(is_batchable=True, cli_args=SimpleNamespace(kv_bits=8))
    server = SimpleNamespace(model_provider=provider, cli_args=provider.cli_args)
    assert not ResponseGenerator._is_batchable(server, SimpleNamespace(seed=None))


def complete(port, prompt, out):
    body = json.dumps({"prompt": prompt, "max_tokens": 30, "temperature": 0})
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        body.encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as r:
        out[prompt] = json.loads(r.read())


def test_server_with_kv_bits_answers_concurrent_requests_on_localhost(make_tiny_dir):
    port = free_port()
    cmd = [
        sys.executable, "-m", "mlx_lm_patched.server",
        "--model", str(make_tiny_dir("llama_sliding")), "--port", str(port),
        "--kv-bits", "8", "--quantized-kv-start", "0",
    ]  # fmt: skip
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        for _ in range(300):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        out = {}
        prompts = ["The key and value cache", "A sliding window keeps", "Tests"]
        threads = [
            threading.Thread(target=complete, args=(port, p, out)) for p in prompts
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert set(out) == set(prompts)
        assert all(r["usage"]["completion_tokens"] > 0 for r in out.values())
    finally:
        server.terminate()
        stderr = server.communicate(timeout=30)[1].decode()
    assert "generation thread died" not in stderr


def test_every_batch_step_holds_the_prompt_cache_budget(patched):
    from mlx_lm.server import ResponseGenerator

    source = inspect.getsource(ResponseGenerator._generate)
    step = source[source.index("for _ in self._time_budget:") :]
    step = step[: step.index("uids_to_remove = self._share_object")]
    # After the step's inserts, trimmed to the budget less the running batch.
    assert "hold_prompt_cache_bytes()" in step
    assert step.rindex("insert_cache(") < step.rindex("hold_prompt_cache_bytes()")
    hold = source[source.index("def hold_prompt_cache_bytes") :]
    hold = hold[: hold.index("\n\n")]
    assert "trim_to(n_bytes=total - active)" in hold
    assert "active = batch_generator.prompt_cache_nbytes" in hold
