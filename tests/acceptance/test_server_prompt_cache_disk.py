"""``python -m mlx_lm_patched.server --prompt-cache-dir DIR``: a prompt
served, the server stopped and started again on DIR, the same prompt is
served from disk (the reply's cached tokens) with the same text; corrupt
and foreign files in DIR are skipped with a warning naming them, and the
server still answers.

Every entry is queued for DIR as soon as it is inserted, with
``--prompt-cache-size 0`` (the RAM tier holds none) and with the default
size (RAM keeps it too), so DIR is filled by the first request. With
bfloat16 weights and with 8-bit caches, a hit from disk after a restart
answers as a hit from memory did before it.
"""

import os

import pytest
from cache_dir import complete, entries, interrupt
from harness import Server


def test_prompt_is_served_from_disk_after_a_restart(model_dir, tmp_path):
    model, cache_dir = model_dir("llama"), tmp_path / "cache"
    flags = ["--prompt-cache-dir", cache_dir, "--prompt-cache-size", 0]

    with Server(model, *flags, log=tmp_path / "first.log") as server:
        text, cached, prompt_tokens = complete(server)
        assert entries(cache_dir)  # written while the server runs
        interrupt(server)
    written = entries(cache_dir, seconds=0)
    with Server(model, *flags, log=tmp_path / "restarted.log") as server:
        again, cached_again, _ = complete(server)

    assert cached == 0, server.log()
    assert cached_again == prompt_tokens - 1, server.log()  # the last token is fed
    assert again == text
    assert set(written) <= set(os.listdir(cache_dir))

    for name in written:  # truncated
        with open(cache_dir / name, "r+b") as f:
            f.truncate(os.path.getsize(cache_dir / name) // 2)
    (cache_dir / "foreign.safetensors").write_bytes(b"not a prompt cache" * 100)
    with Server(model, *flags, log=tmp_path / "corrupt.log") as server:
        answer, cached_corrupt, _ = complete(server)
        healthy = server.get("/health")["status"]
    log = server.log_path.read_text()

    assert healthy == "ok" and answer == text and cached_corrupt == 0, log
    for name in [*written, "foreign.safetensors"]:
        assert f"skipping {cache_dir / name}" in log, log
    assert "Traceback" not in log, log


def test_entries_in_memory_are_written_as_they_are_stored(model_dir, tmp_path):
    model, cache_dir = model_dir("llama"), tmp_path / "cache"
    flags = ["--prompt-cache-dir", cache_dir]

    with Server(model, *flags, log=tmp_path / "first.log") as server:
        text, _, prompt_tokens = complete(server)
        assert entries(cache_dir)  # held in memory, and on disk
        interrupt(server)
    assert entries(cache_dir, seconds=0)
    with Server(model, *flags, log=tmp_path / "restarted.log") as server:
        again, cached_again, _ = complete(server)

    assert again == text and cached_again == prompt_tokens - 1


# name: (model overrides, server flags): the caches the seeds' SSD tiers broke on.
KINDS = {
    "bfloat16": ({"dtype": "bfloat16"}, []),
    "kv8": ({}, ["--kv-bits", 8, "--quantized-kv-start", 0]),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_disk_hit_after_a_restart_answers_as_a_memory_hit(
    kind, make_tiny_dir, tmp_path
):
    overrides, kv_flags = KINDS[kind]
    model, cache_dir = make_tiny_dir("llama", **overrides), tmp_path / "cache"
    flags = ["--prompt-cache-dir", cache_dir, *kv_flags]

    with Server(model, *flags, log=tmp_path / "first.log") as server:
        complete(server)
        from_memory, cached, _ = complete(server)
        interrupt(server)
    with Server(model, *flags, log=tmp_path / "restarted.log") as server:
        from_disk, cached_disk, _ = complete(server)

    assert cached > 0 and cached_disk == cached
    assert from_disk == from_memory
