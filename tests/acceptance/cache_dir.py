"""Acceptance helpers for a server's ``--prompt-cache-dir``: its entry and
block files, a completion against it, and a stop that writes what is queued."""

import json
import os
import signal
import time

from harness import LONG, MAX_TOKENS

BODY = {"prompt": LONG, "max_tokens": MAX_TOKENS, "temperature": 0}


def complete(server):
    status, reply = server.post("/v1/completions", BODY)
    assert status == 200, reply
    usage = reply["usage"]
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return reply["choices"][0]["text"], cached, usage["prompt_tokens"]


def entries(directory, seconds=60):
    """The entry files in ``directory`` once one is there (the writer's
    thread); block files (``prompt_cache_disk_blocks``) apart."""
    deadline = time.monotonic() + seconds
    while True:
        found = [f for f in os.listdir(directory) if is_entry(f)]
        if found:
            return found
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    raise TimeoutError(f"no entry written to {directory} in {seconds} s")


def is_entry(name):
    return name.endswith(".safetensors") and not name.endswith(".block.safetensors")


def load_entry(directory, name):
    """The cache in entry file ``name``, its block files joined in."""
    from mlx_lm.models.prompt_cache_disk import DiskPromptCache

    tier = DiskPromptCache(str(directory))
    try:
        return tier._load(name)
    finally:
        tier.close()


def interrupt(server):
    """Stop ``server`` with Ctrl-C (SIGINT): it writes what is queued and exits 0."""
    os.kill(server.proc.pid, signal.SIGINT)
    status = server.proc.wait(timeout=60)
    assert status == 0, server.log()
    assert "Traceback" not in server.log_path.read_text(), server.log()


def named_blocks(directory):
    """Per entry file in ``directory``, the block files its header names."""
    out = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors") and ".block." not in name:
            with open(directory / name, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                meta = json.loads(f.read(n))["__metadata__"]
            out[name] = set(json.loads(meta.get("0.blocks", '{"files": []}'))["files"])
    return out


def block_files(directory):
    return {n for n in os.listdir(directory) if n.endswith(".block.safetensors")}


def written(directory, entries, seconds=60):
    """Wait (bounded) until ``directory`` holds ``entries`` entry files."""
    deadline = time.monotonic() + seconds
    while len(named_blocks(directory)) < entries:
        assert time.monotonic() < deadline, os.listdir(directory)
        time.sleep(0.2)
