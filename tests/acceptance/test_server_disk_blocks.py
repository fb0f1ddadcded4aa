"""``python -m mlx_lm_patched.server --prompt-cache-dir DIR``: chats behind
one system prompt keep it on disk once (issue #28).

Chats sharing a system prompt of about 1,000 tokens leave DIR at about the
prefix once plus their own tokens (``prompt_cache_disk_blocks``: the
prefix's blocks are block files every entry names), where whole entries
hold the prefix once per chat; a restarted server gets a disk hit whose
greedy tokens are a cold server's; and a second replica on DIR serves the
first's entry and writes its own chats against the same block files.
"""

import os
import signal

from cache_dir import block_files, named_blocks, written
from harness import LLAMA_TOKEN_BYTES, REPORT, WORDS, Server, system_chat

SYSTEM = " ".join((WORDS * 2)[:560])  # about 1,000 tokens on the tiny tokenizer
CHATS = 4


def chat(server, i):
    """``(text, cached tokens, prompt tokens)`` of chat ``i``."""
    status, reply = server.post("/v1/chat/completions", system_chat(SYSTEM, i, 8))
    assert status == 200, reply
    usage = reply["usage"]
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return reply["choices"][0]["message"]["content"], cached, usage["prompt_tokens"]


def dir_bytes(directory):
    return sum(os.path.getsize(directory / n) for n in os.listdir(directory))


def test_chats_keep_their_system_prompt_on_disk_once_and_a_restart_serves_it(
    model_dir, tmp_path
):
    model, cache_dir = model_dir("llama"), tmp_path / "cache"
    flags = ["--prompt-cache-dir", cache_dir, "--prompt-cache-disk-block", 64]
    with Server(model, *flags, log=tmp_path / "first.log") as server:
        answers = [chat(server, i) for i in range(CHATS)]
        os.kill(server.proc.pid, signal.SIGTERM)  # writes what is queued
        assert server.proc.wait(timeout=60) == 0, server.log()
    entries = named_blocks(cache_dir)
    shared = set.intersection(*entries.values())
    prompt = answers[0][2]
    once = LLAMA_TOKEN_BYTES * (prompt + CHATS * 128)  # the prefix, each chat's own
    ratio = dir_bytes(cache_dir) / once
    with Server(model, *flags, log=tmp_path / "restarted.log") as server:
        text, cached, _ = chat(server, 0)
    REPORT.append(
        f"server disk blocks: {CHATS} chats of a {prompt}-token prompt, "
        f"{len(entries)} entries, {len(block_files(cache_dir))} block files "
        f"({len(shared)} named by every entry), DIR {dir_bytes(cache_dir)} B = "
        f"{ratio:.2f}x of the prefix once plus 128 tokens a chat"
    )
    assert all(c == 0 for _, c, _ in answers[:1])  # the first was cold
    assert len(shared) >= prompt // 64 - 2  # the system prompt's blocks
    assert ratio <= 1.3  # whole entries: one prefix per entry
    assert cached == prompt - 1 and text == answers[0][0]
    assert "Prompt cache disk hit" in server.log_path.read_text()


def test_a_second_replica_writes_against_the_same_block_files(model_dir, tmp_path):
    model, cache_dir = model_dir("llama"), tmp_path / "cache"
    flags = ["--prompt-cache-dir", cache_dir, "--prompt-cache-disk-block", 64]
    replicas = [
        Server(model, *flags, log=tmp_path / f"replica{i}.log") for i in range(2)
    ]
    try:
        for r in replicas:
            r.wait_healthy()
        cold = chat(replicas[0], 0)
        written(cache_dir, 1)
        first = block_files(cache_dir)
        from_disk = chat(replicas[1], 0)
        other = chat(replicas[1], 1)
        written(cache_dir, 2)
        entries = named_blocks(cache_dir)
    finally:
        for r in replicas:
            r.stop()
    log = replicas[1].log_path.read_text()
    shared = set.intersection(*entries.values())
    assert from_disk[0] == cold[0] and from_disk[1] == cold[2] - 1, log
    assert "Prompt cache disk hit" in log
    assert other[1] >= cold[2] - 40  # all but its question, cached
    # The second replica's entries name the first's block files of the prefix
    assert first <= block_files(cache_dir)
    assert len(shared & first) >= cold[2] // 64 - 2
