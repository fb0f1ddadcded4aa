"""``python -m mlx_lm_patched.server`` under bursts of connections (issue 48).

Upstream's server (0.32.2, and main before issue 48) listens with the
standard library's backlog of 5 (a 48-client run had 3 connections reset),
keeps an idle connection and its thread for good (2,520 idle connections
made 1,293 threads), and starts a thread for every connection. Here: a
backlog of ``--listen-backlog`` (1024), idle connections closed after
``--idle-timeout``, at most ``--max-connections`` served at once and a 503
past them.
"""

import json
import socket
import subprocess
import threading
import time

import pytest
from harness import REPORT, Server

from mlx_lm_patched.demo import tiny_train

HEALTH = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"


@pytest.fixture(scope="module")
def demo_model():
    return tiny_train.demo_model_dir()


def answer(port, request=HEALTH, timeout=30):
    """The status line and body of ``request`` on a new connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head.split(b"\r\n")[0].decode(), body


def listen_backlog(port):
    """The backlog of the socket listening on ``port`` (``ss``'s Send-Q)."""
    out = subprocess.run(
        ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True
    ).stdout
    return int(out.split()[2])


def test_64_simultaneous_connections_are_all_answered(demo_model, tmp_path):
    with Server(demo_model, log=tmp_path / "server.log") as server:
        backlog = listen_backlog(server.port)
        REPORT.append(f"listen backlog: {backlog}")
        barrier = threading.Barrier(64)
        results = []

        def client():
            barrier.wait()
            try:
                results.append(answer(server.port)[0])
            except OSError as e:
                results.append(repr(e))

        threads = [threading.Thread(target=client) for _ in range(64)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        took = time.monotonic() - start
        failed = [r for r in results if not r.endswith("200 OK")]
        REPORT.append(
            f"64 simultaneous connections: {len(results) - len(failed)} answered "
            f"in {took:.2f} s, {len(failed)} failed"
        )
        assert backlog >= 1024
        assert len(results) == 64 and not failed, failed
        # With a backlog of 5 the kernel drops SYNs (ListenOverflows): the
        # clients resend after 1 s, 3 s, 7 s (5-28 s for 64 on main).
        assert took < 3, f"64 answers took {took:.1f} s"


def test_an_idle_connection_is_closed_after_the_idle_timeout(demo_model, tmp_path):
    with Server(demo_model, "--idle-timeout", 1, log=tmp_path / "server.log") as server:
        with socket.create_connection(("127.0.0.1", server.port)) as idle:
            idle.settimeout(10)
            start = time.monotonic()
            assert idle.recv(1) == b""  # closed by the server, nothing sent
            assert time.monotonic() - start < 5
        assert answer(server.port)[0].endswith("200 OK")


def test_connections_past_max_connections_get_a_503(demo_model, tmp_path):
    with Server(
        demo_model, "--max-connections", 2, log=tmp_path / "server.log"
    ) as server:
        held = [socket.create_connection(("127.0.0.1", server.port)) for _ in "ab"]
        time.sleep(0.5)  # both accepted, each holding a handler thread
        status, body = answer(server.port)
        assert status.endswith("503 Service Unavailable"), status
        assert "too many connections" in json.loads(body)["error"]
        for s in held:
            s.close()
        deadline = time.monotonic() + 10
        while not (status := answer(server.port)[0]).endswith("200 OK"):
            assert time.monotonic() < deadline, status
            time.sleep(0.2)
