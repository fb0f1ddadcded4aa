"""Acceptance helpers: the tiny models, the real command-line fronts run in
subprocesses, and a server on 127.0.0.1 that is always stopped by its PID.

CLI results are kept for the session: the same command is the reference of
several tests and runs once.
"""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from ringref import free_port

from mlx_lm_patched.demo import tiny

# name: (family, overrides). Head dims 16, 96, 64 (the one upstream can
# quantize, on a model with only full attention), 80; seeds chosen so greedy
# decoding does not settle into a loop within MAX_TOKENS.
MODELS = {
    "llama": ("llama", {}),
    "llama_sliding": ("llama_sliding", {"head_dim": 96}),
    "qwen3": ("qwen3", {"head_dim": 64, "seed": 2}),
    "gemma3_text": ("gemma3_text", {"head_dim": 80}),
}

WORDS = tiny.TEXT.split()
# About 20 and 150 tokens as plain text; the chat template adds 8.
SHORT = " ".join(WORDS[:20])
LONG = " ".join(WORDS[40:190])
OTHER_SHORT = " ".join(WORDS[200:220])
OTHER_LONG = " ".join(WORDS[221:370])
MAX_TOKENS = 24
# The server's --prompt-cache-slack default: tokens a wrapped ring trims back.
SLACK = 8
# Bytes of K and V a token in every layer of tiny llama (float32).
LLAMA = tiny.model_config(MODELS["llama"][0], **MODELS["llama"][1])
LLAMA_TOKEN_BYTES = (
    2
    * LLAMA["num_hidden_layers"]
    * LLAMA["num_key_value_heads"]
    * LLAMA["head_dim"]
    * 4
)


def system_chat(system: str, i: int, max_tokens: int) -> dict:
    """A greedy chat request behind ``system``; question ``i`` is its own."""
    question = f"question {i}: {' '.join(WORDS[i : i + 6])}"
    return {
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": question},
        ],
        "max_tokens": max_tokens,
        "temperature": 0,
    }


# The cache options of generate and cache_prompt.
OPTIONS = {
    "default": [],
    "max-kv-128": ["--max-kv-size", 128],
    "max-kv-48": ["--max-kv-size", 48],
    "kv4-start0": ["--kv-bits", 4, "--quantized-kv-start", 0],
    "kv4-start100": ["--kv-bits", 4, "--quantized-kv-start", 100],
    "kv8-start0": ["--kv-bits", 8, "--quantized-kv-start", 0],
    "kv8-start100": ["--kv-bits", 8, "--quantized-kv-start", 100],
    "kv8-start0-max-kv-48": [
        "--kv-bits", 8, "--quantized-kv-start", 0, "--max-kv-size", 48,
    ],  # fmt: skip
}
# The quantized ring (--kv-bits with --max-kv-size) only on these.
COMBINED = ("llama", "gemma3_text")


def cells(pairs, xfail=None):
    """``pytest.param``s of ``(model, option)``; those in ``xfail`` marked."""
    xfail = xfail or {}
    return [
        pytest.param(
            model,
            option,
            id=f"{model}-{option}",
            marks=(
                [pytest.mark.xfail(strict=True, reason=xfail[model, option])]
                if (model, option) in xfail
                else []
            ),
        )
        for model, option in pairs
    ]


TIMEOUT = 120  # seconds for one CLI run


def needs_upstream():
    """Skip where mlx-lm is the vendored wheel (``make vendor``): it has the
    patches, so there is no upstream to run beside them."""
    import mlx_lm

    if "+patched." in mlx_lm.__version__:
        pytest.skip(f"mlx-lm {mlx_lm.__version__} is the vendored wheel")


# Lines printed at the end of the run (conftest's terminal summary).
REPORT = []


def run(*argv, upstream=False, env=None, timeout=TIMEOUT):
    """Run ``python -m mlx_lm_patched.<argv[0]> argv[1:]`` (``mlx_lm.`` with
    ``upstream``, without importing mlx_lm_patched at all)."""
    front, *args = argv
    if upstream:
        needs_upstream()
    package = "mlx_lm" if upstream else "mlx_lm_patched"
    cmd = [sys.executable, "-m", f"{package}.{front}", *map(str, args)]
    done = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
    )
    done.cmd = " ".join(cmd[1:])
    return done


_runs = {}


def cli(*argv, upstream=False):
    """``run``, kept for the session: one run per distinct command."""
    key = (upstream, tuple(map(str, argv)))
    if key not in _runs:
        _runs[key] = run(*argv, upstream=upstream)
    return _runs[key]


def ok(done):
    """Assert a run exited 0 and return its stdout."""
    assert done.returncode == 0, f"{done.cmd}\nexit {done.returncode}\n{done.stderr}"
    return done.stdout


def text_of(done):
    """The generated text of ``mlx_lm.generate``: between its two ``==========``."""
    parts = ok(done).split("==========\n")
    assert len(parts) == 3, done.stdout
    assert parts[1].endswith("\n"), parts[1]
    return parts[1][:-1]


def generation_tokens(done):
    """The token count of the ``Generation: N tokens`` line."""
    (line,) = [l for l in done.stdout.splitlines() if l.startswith("Generation:")]
    return int(line.split()[1])


def assert_clean_error(done):
    """Exit 0, or a non-zero exit with a one-line message and no traceback."""
    if done.returncode == 0:
        return
    lines = [l for l in done.stderr.splitlines() if l.strip()]
    assert "Traceback" not in done.stderr, f"{done.cmd}\n{done.stderr[-3000:]}"
    assert lines, f"{done.cmd}: exit {done.returncode} without a message"


def generate(model, prompt=LONG, *flags, upstream=False, max_tokens=MAX_TOKENS):
    """Greedy ``generate`` of ``prompt`` (chat template applied)."""
    args = ["--model", model, "--prompt", prompt, "--max-tokens", max_tokens]
    return cli("generate", *args, "--temp", 0, *flags, upstream=upstream)


# The server.


def rss_bytes(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def _ctrl_c_reaches():
    """In a server's process before it starts: Ctrl-C (SIGINT) stops it as it
    stops a server started from a terminal, also when the tests run as a
    background job (whose children start with SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class Server:
    """``python -m mlx_lm_patched.server`` (``mlx_lm.server`` with
    ``upstream``) on 127.0.0.1, stopped by PID."""

    def __init__(self, model, *flags, log, upstream=False):
        if upstream:
            needs_upstream()
        self.port = free_port()
        self.log_path = Path(log)
        front = "mlx_lm.server" if upstream else "mlx_lm_patched.server"
        cmd = [sys.executable, "-m", front, "--model", str(model)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *map(str, flags)]
        self.cmd = " ".join(cmd[1:])
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            cmd, stdout=self._log, stderr=subprocess.STDOUT, preexec_fn=_ctrl_c_reaches
        )

    def __enter__(self):
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    def wait_healthy(self, seconds=120):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"server exited:\n{self.log()}"
            try:
                if self.get("/health")["status"] == "ok":
                    return
            except (OSError, ValueError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not healthy after {seconds} s:\n{self.log()}")

    def stop(self):
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=20)
        self._log.close()

    def log(self):
        return self.log_path.read_text()[-4000:]

    def rss(self):
        return rss_bytes(self.proc.pid)

    def get(self, path):
        url = f"http://127.0.0.1:{self.port}{path}"
        with urllib.request.urlopen(url, timeout=10) as r:
            return json.loads(r.read())

    def post(self, path, body, timeout=120, on_event=None):
        """``(status, parsed body)``; a streaming reply parses to its list of
        ``data:`` events, ending with ``"[DONE]"``, each passed to ``on_event``
        as it arrives."""
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as r:
                if not body.get("stream"):
                    return r.status, json.loads(r.read())
                events = []
                for line in r:
                    line = line.decode().rstrip("\r\n")
                    if line.startswith("data: "):
                        data = line[len("data: ") :]
                        events.append(data if data == "[DONE]" else json.loads(data))
                        if on_event is not None:
                            on_event(events[-1])
                    else:  # keepalives are SSE comments
                        assert line == "" or line.startswith(":"), line
                return r.status, events
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")
