"""``python -m mlx_lm_patched.server`` under bad requests (issue 25): each ends in a
4xx naming what is wrong, or (a client that went away) in its generation
cancelled, and the same server answers a valid request after every one.

Upstream's server (0.32.2) lets a ``logit_bias`` id past the vocabulary
write out of bounds (the process aborts), loses its generation thread to an
empty prompt, a huge ``top_k`` or non-string ``stop`` words (/health is 503
for good), drops the connection with no status on a body that is not UTF-8,
JSON nested 100,000 deep or ``seed: -1``, accepts ``max_tokens`` 2**63, and
keeps generating for a non-stream client that hung up.
"""

import http.client
import json
import socket
import time

import pytest
from harness import SHORT, Server

from mlx_lm_patched.demo import tiny

VOCAB = tiny.VOCAB_SIZE
VALID = {"prompt": SHORT, "max_tokens": 4, "temperature": 0}
# name: (path, body or raw bytes, the parameter the 400 names)
ATTACKS = {
    "logit_bias id = vocab": (
        "/v1/completions",
        {**VALID, "logit_bias": {str(VOCAB): 5}},
        "logit_bias",
    ),
    "logit_bias id < 0": (
        "/v1/completions",
        {**VALID, "logit_bias": {"-1": 5}},
        "logit_bias",
    ),
    "empty prompt": ("/v1/completions", {**VALID, "prompt": ""}, "prompt"),
    "empty messages": (
        "/v1/chat/completions",
        {**VALID, "prompt": None, "messages": []},
        "messages",
    ),
    "top_k 1e9": (
        "/v1/completions",
        {**VALID, "temperature": 1.0, "top_k": 10**9},
        "top_k",
    ),
    "top_k = vocab": (
        "/v1/completions",
        {**VALID, "temperature": 1.0, "top_k": VOCAB},
        "top_k",
    ),
    "top_p 1.5": ("/v1/completions", {**VALID, "top_p": 1.5}, "top_p"),
    "min_p 2": ("/v1/completions", {**VALID, "min_p": 2}, "min_p"),
    "temperature nan": (
        "/v1/completions",
        b'{"prompt": "a", "temperature": NaN}',
        "temperature",
    ),
    "repetition_context_size 1e12": (
        "/v1/completions",
        {**VALID, "repetition_penalty": 1.1, "repetition_context_size": 10**12},
        "repetition_context_size",
    ),
    "stop [1, 2]": ("/v1/completions", {**VALID, "stop": [1, 2]}, "stop"),
    "seed -1": ("/v1/completions", {**VALID, "seed": -1}, "seed"),
    "max_tokens 2**63": (
        "/v1/completions",
        {**VALID, "max_tokens": 2**63},
        "max_tokens",
    ),
    "max_tokens true": ("/v1/completions", {**VALID, "max_tokens": True}, "max_tokens"),
    "body not UTF-8": ("/v1/completions", b'{"prompt": "\xff\xfe"}', "UTF-8"),
    "JSON 100k deep": ("/v1/completions", b"[" * 100_000 + b"]" * 100_000, "JSON"),
}


def post_raw(port, path, body, headers=None, timeout=60):
    """``(status, body text)`` of one POST; ``(None, why)`` where the server
    closed the connection without a status."""
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        headers = {"Content-Type": "application/json", **(headers or {})}
        headers.setdefault("Content-Length", str(len(body)))
        conn.putrequest("POST", path, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders()
        conn.send(body)
        r = conn.getresponse()
        return r.status, r.read().decode(errors="replace")
    except (OSError, http.client.HTTPException) as e:
        return None, repr(e)
    finally:
        conn.close()


_spellings = iter(range(1, 1000))


def unseen_path(model):
    """``model``'s directory spelled as no request named it before: the
    handler does not know its vocabulary."""
    return str(model) + "/." * next(_spellings)


def answers_a_valid_request(server):
    status, body = server.post("/v1/completions", VALID, timeout=60)
    return status == 200 and body["usage"]["completion_tokens"] > 0


def cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def goes_idle(pid, seconds=60, window=1.0, ticks=10):
    """Whether the process uses under ``ticks`` CPU ticks in some ``window``
    within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        before = cpu_ticks(pid)
        time.sleep(window)
        if cpu_ticks(pid) - before < ticks:
            return True
    return False


def abandon(port, max_tokens, n=2):
    """Send ``n`` non-stream requests for ``max_tokens`` tokens and hang up."""
    body = json.dumps({**VALID, "max_tokens": max_tokens}).encode()
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        socks.append(s)
    time.sleep(1.0)  # let them start generating
    for s in socks:
        s.close()


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    with Server(model_dir("llama"), log=log) as s:
        yield s


@pytest.mark.parametrize("name", list(ATTACKS))
def test_bad_request_gets_a_400_naming_it_and_the_server_goes_on(server, name):
    path, body, names = ATTACKS[name]
    status, text = post_raw(server.port, path, body)
    assert status == 400, f"{name}: {status} {text}\n{server.log()}"
    assert names in text
    assert server.get("/health")["status"] == "ok"
    assert answers_a_valid_request(server), server.log()


def test_body_over_the_size_limit_gets_a_413_before_it_is_read(server):
    # Declares 1 TB and sends nothing: the server answers without waiting.
    status, text = post_raw(
        server.port, "/v1/completions", b"", {"Content-Length": str(10**12)}
    )
    assert status == 413, text
    status, text = post_raw(
        server.port, "/v1/completions", b"{}", {"Content-Length": "-5"}
    )
    assert status == 400, text
    assert answers_a_valid_request(server)


def test_non_stream_requests_whose_client_left_are_cancelled(server):
    """Two abandoned non-stream requests for the most tokens the server takes
    stop generating: the server goes idle, which it would not for hours."""
    abandon(server.port, max_tokens=2**31 - 1)
    assert goes_idle(server.proc.pid), server.log()
    assert "client disconnected" in server.log_path.read_text()
    assert answers_a_valid_request(server)


def test_logit_bias_the_handler_cannot_check_fails_its_request_alone(server, model_dir):
    """Named by another path to the same model, the request's vocabulary is
    not known to the handler: the generation thread refuses the id instead
    of writing past the logits, and the request alone fails."""
    model = str(model_dir("llama")) + "/"
    body = {**VALID, "model": model, "logit_bias": {str(VOCAB): 5}}
    status, text = post_raw(server.port, "/v1/completions", body)
    assert status == 400, text
    assert "logit_bias" in text
    assert server.proc.poll() is None
    assert server.get("/health")["status"] == "ok"
    assert answers_a_valid_request(server)


def test_a_stream_that_fails_ends_with_an_error_event(server, model_dir):
    """Once its headers are sent, a failing stream gets its error as the
    last event, not a connection closed mid-stream."""
    model = unseen_path(model_dir("llama"))
    body = {**VALID, "model": model, "logit_bias": {str(VOCAB): 5}, "stream": True}
    status, events = server.post("/v1/completions", body)
    assert status == 200
    assert "logit_bias" in events[-1]["error"]
    assert answers_a_valid_request(server)
