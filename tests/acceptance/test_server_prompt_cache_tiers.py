"""``python -m mlx_lm_patched.server --prompt-cache-dir DIR`` stopped the
ways services are stopped: after SIGTERM (systemd, docker, Kubernetes) it
exits 0 having written its entries, and a restarted server serves the
prompt from disk with the right ``cached_tokens`` and a cold server's
tokens; kill -9 five seconds after an answer keeps it too (entries are
written as they are stored). Two replicas on one DIR serve each other's
entries, right, within one budget. An entry the write queue has no room
for is not written and the log counts it. The log says which tier served
each request and how big both tiers are.
"""

import fcntl
import os
import signal
import threading
import time

from harness import MAX_TOKENS, REPORT, WORDS, Server

PROMPTS = [" ".join(WORDS[i * 45 : i * 45 + 150]) for i in range(6)]


def complete(server, prompt=PROMPTS[0]):
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    status, reply = server.post("/v1/completions", body)
    assert status == 200, reply
    usage = reply["usage"]
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return reply["choices"][0]["text"], cached, usage["prompt_tokens"]


def stopped(server, sig):
    """The log of ``server`` once ``sig`` stopped it cleanly."""
    os.kill(server.proc.pid, sig)
    status = server.proc.wait(timeout=60)
    log = server.log_path.read_text()
    if sig != signal.SIGKILL:
        assert status == 0, log  # no abort
        assert "Traceback" not in log, log
    return log


def test_a_restart_after_sigterm_serves_the_prompt_from_disk(model_dir, tmp_path):
    model, cache_dir = model_dir("llama"), tmp_path / "cache"
    flags = ["--prompt-cache-dir", cache_dir]

    with Server(model, *flags, log=tmp_path / "first.log") as server:
        cold, cached, prompt_tokens = complete(server)
        again, cached_in_memory, _ = complete(server)
        start = time.monotonic()
        log = stopped(server, signal.SIGTERM)
        REPORT.append(
            f"server with --prompt-cache-dir, SIGTERM to exit 0: "
            f"{time.monotonic() - start:.2f} s"
        )
    with Server(model, *flags, log=tmp_path / "restarted.log") as server:
        from_disk, cached_from_disk, _ = complete(server)
    restarted = server.log_path.read_text()

    assert cached == 0 and again == cold
    # A miss says what asking the disk tier cost
    assert f"Prompt cache miss: 0 of {prompt_tokens} tokens (disk tier asked in " in log
    hit = f"{cached_in_memory} of {prompt_tokens} tokens"
    assert f"Prompt cache memory hit: {hit}" in log
    assert "for at most 10.0 s" in log and "Prompt cache: written " in log
    assert cached_from_disk == prompt_tokens - 1  # the last token is fed
    assert f"Prompt cache disk hit: {cached_from_disk} of {prompt_tokens}" in (
        restarted
    )
    assert "- disk: " in restarted and "0 dropped" in restarted
    assert from_disk == cold


def test_kill_9_five_seconds_after_an_answer_keeps_it(model_dir, tmp_path):
    model, cache_dir = model_dir("llama"), tmp_path / "cache"
    flags = ["--prompt-cache-dir", cache_dir]

    with Server(model, *flags, log=tmp_path / "first.log") as server:
        cold, _, prompt_tokens = complete(server)
        time.sleep(5)
        stopped(server, signal.SIGKILL)
    with Server(model, *flags, log=tmp_path / "restarted.log") as server:
        from_disk, cached, _ = complete(server)

    assert cached == prompt_tokens - 1, server.log()
    assert from_disk == cold


def entry_bytes(directory):
    return sum(
        os.path.getsize(directory / f)
        for f in os.listdir(directory)
        if f.endswith(".safetensors")
    )


def settled(directory, quiet=1.0, seconds=60):
    """Wait until ``directory`` is unchanged for ``quiet`` s with no file
    being written: the replicas' write-behind queues are on disk."""
    deadline, last, since = time.monotonic() + seconds, None, time.monotonic()
    while time.monotonic() < deadline:
        now = sorted((f, os.path.getsize(directory / f)) for f in os.listdir(directory))
        if now != last or any(f.endswith(".tmp") for f, _ in now):
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.1)
    raise TimeoutError(f"{directory} still changing after {seconds} s")


def test_two_replicas_on_one_directory_serve_each_others_entries(model_dir, tmp_path):
    model, cache_dir = model_dir("llama"), tmp_path / "cache"
    # Room for every prompt's entries and blocks: which entries a tight
    # shared budget keeps is test_server_disk_hardening's (replicas).
    budget = 3_000_000
    flags = ["--prompt-cache-dir", cache_dir, "--prompt-cache-disk-bytes", budget]
    replicas = [
        Server(model, *flags, log=tmp_path / f"replica{i}.log") for i in range(2)
    ]
    answers, largest = {}, []

    def serve(server, prompts):
        for prompt in prompts:
            answers[server, prompt] = complete(server, prompt)
            largest.append(entry_bytes(cache_dir))

    try:
        for r in replicas:
            r.wait_healthy()
        # Both write (and read) at once: each its own half of the prompts.
        threads = [
            threading.Thread(target=serve, args=(r, PROMPTS[i::2]))
            for i, r in enumerate(replicas)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        settled(cache_dir)  # each one's newest entry written
        # Then each asks for the other's newest prompt, then the others'.
        for i, r in enumerate(replicas):
            newest = PROMPTS[1 - i :: 2][-1]
            answers[r, "again", newest] = complete(r, newest)
        for i, r in enumerate(replicas):
            for prompt in PROMPTS[1 - i :: 2][:-1]:
                answers[r, "again", prompt] = complete(r, prompt)
        logs = [stopped(r, signal.SIGTERM) for r in replicas]
    finally:
        for r in replicas:
            r.stop()

    for i, r in enumerate(replicas):
        other = replicas[1 - i]
        for prompt in PROMPTS[1 - i :: 2]:
            text, cached, prompt_tokens = answers[r, "again", prompt]
            assert text == answers[other, prompt][0]  # never a wrong cache
        _, cached, prompt_tokens = answers[r, "again", PROMPTS[1 - i :: 2][-1]]
        assert cached == prompt_tokens - 1, logs[i]
        assert "Prompt cache disk hit" in logs[i]
        for torn in ("does not match", "changed while", "changed since"):
            assert torn not in logs[i], logs[i]
    assert max(largest) <= budget and entry_bytes(cache_dir) <= budget


def test_a_write_the_queue_has_no_room_for_is_counted_in_the_log(model_dir, tmp_path):
    model, cache_dir = model_dir("llama"), tmp_path / "cache"
    flags = ["--prompt-cache-dir", cache_dir, "--prompt-cache-queue-bytes", 1]

    with Server(model, *flags, log=tmp_path / "server.log") as server:
        # The writer waits for the directory's lock: what it has stays queued.
        fd = os.open(cache_dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            for prompt in PROMPTS[:2]:
                complete(server, prompt)
                time.sleep(0.5)  # idle: the server queues what it stored
            complete(server, PROMPTS[2])  # its stats line counts the drops
        finally:
            os.close(fd)
        log = stopped(server, signal.SIGTERM)

    assert "dropped so far" in log and "--prompt-cache-queue-bytes 1;" in log
    (stats,) = [l for l in log.splitlines() if "- disk: " in l][2:3]
    assert "queued" in stats and " 0 dropped" not in stats, stats
    assert entry_bytes(cache_dir) > 0  # the first entry, written once unlocked
