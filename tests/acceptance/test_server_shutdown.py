"""``python -m mlx_lm_patched.server`` stopped during a long batched prefill
(issue 48): six streaming clients of ~1,200-token prompts on the demo model.

Upstream's server (0.32.2, and main before issue 48) waited for the batch
step to end (one 2,048-token step of six prompts: ~6 s on a 2-core CPU,
~30 s on a loaded one), then dropped every stream without its end (no
``[DONE]``); a second SIGTERM gave a ``KeyboardInterrupt`` traceback and
exit status -2. Stopped, the server must end every stream cleanly and exit
0 within ``STOP_SECONDS`` and a margin, plus the drain bound of a disk tier;
a second signal must end it at once, 0 or 130, without a traceback.
"""

import os
import signal
import threading
import time

import pytest
from harness import REPORT, Server
from mlx_lm.models.prompt_cache_disk import DiskPromptCache

from mlx_lm_patched.demo import tiny, tiny_train

# The stop's bound without a disk tier (the generation thread's and the
# handlers'); a disk tier adds its drain bound.
BOUND = 5.0
DRAIN_SECONDS = DiskPromptCache.drain_seconds
CLIENTS = 6


@pytest.fixture(scope="module")
def demo_model():
    return tiny_train.demo_model_dir()


def prefilling(server, clients=CLIENTS):
    """Start ``clients`` streaming requests of ~1,200 tokens each; return
    once every one has joined the batch and its prefill runs, with the dict
    their threads fill: ``i: (status, events)`` or ``i: exception``."""
    results = {}

    def client(i):
        body = {
            "prompt": f"{i} {tiny.TEXT} {tiny.TEXT}",
            "max_tokens": 100,
            "temperature": 0,
            "stream": True,
        }
        try:
            results[i] = server.post("/v1/completions", body, timeout=120)
        except Exception as e:
            results[i] = e

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while server.log_path.read_text().count("Prompt Cache: ") < clients:
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.05)
    time.sleep(0.5)  # into the prefill
    return results, threads


@pytest.mark.parametrize(
    "signum, step, disk",
    [
        (signal.SIGTERM, 2048, False),
        (signal.SIGINT, 64, False),
        (signal.SIGTERM, 2048, True),
    ],
    ids=["SIGTERM-one-long-step", "SIGINT-many-steps", "SIGTERM-disk-tier"],
)
def test_stop_during_a_batched_prefill_ends_every_stream_and_exits_0_in_time(
    demo_model, tmp_path, signum, step, disk
):
    # With a disk tier, what memory holds is written for at most its drain bound.
    flags = ["--prompt-cache-dir", tmp_path / "cache"] if disk else []
    bound = BOUND + DRAIN_SECONDS if disk else BOUND
    with Server(
        demo_model, "--prefill-step-size", step, *flags, log=tmp_path / "server.log"
    ) as server:
        results, threads = prefilling(server)
        start = time.monotonic()
        os.kill(server.proc.pid, signum)
        try:
            rc = server.proc.wait(timeout=60)
        finally:
            took = time.monotonic() - start
            for t in threads:
                t.join(timeout=30)
        log = server.log_path.read_text()
        ended = sum(
            isinstance(r, tuple) and r[1][-1:] == ["[DONE]"] for r in results.values()
        )
        REPORT.append(
            f"{signal.Signals(signum).name} during a prefill (step {step}"
            f"{', disk tier' if disk else ''}): exit "
            f"{rc} after {took:.2f} s, {ended} of {CLIENTS} streams ended"
        )
        assert rc == 0, log[-3000:]
        assert took <= bound, f"exited {took:.1f} s after the signal"
        assert "Traceback" not in log, log[-3000:]
        for i in range(CLIENTS):
            status, events = results[i]
            assert status == 200 and events[-1:] == ["[DONE]"], (i, results[i])


def test_a_second_signal_exits_at_once_without_a_traceback(demo_model, tmp_path):
    with Server(
        demo_model, "--prefill-step-size", 2048, log=tmp_path / "server.log"
    ) as server:
        _, threads = prefilling(server)
        os.kill(server.proc.pid, signal.SIGTERM)
        time.sleep(0.5)
        start = time.monotonic()
        if server.proc.poll() is None:
            os.kill(server.proc.pid, signal.SIGTERM)
        rc = server.proc.wait(timeout=60)
        took = time.monotonic() - start
        for t in threads:
            t.join(timeout=30)
        log = server.log_path.read_text()
        REPORT.append(
            f"a second SIGTERM: exit {rc} after {took:.2f} s, "
            f"{'a' if 'Traceback' in log else 'no'} traceback"
        )
        assert rc in (0, 130), log[-3000:]
        assert took <= 1.0, f"exited {took:.1f} s after the second signal"
        assert "Traceback" not in log, log[-3000:]
