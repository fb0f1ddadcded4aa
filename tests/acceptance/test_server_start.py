"""What ``python -m mlx_lm_patched.server`` says at start and leaves on disk:
a start-up line with the disk entries found (count, bytes) and the budgets
in force; ``--prompt-cache-dir`` files ``0600`` in a directory made
``0700`` (they hold the keys and values of users' prompts); ``GET
/v1/models`` without a Hugging Face hub cache lists the local model and
logs no traceback; a prompt past the tokenizer's ``model_max_length`` logs
no "indexing errors" warning.
"""

import json
import os
import re
import stat

from cache_dir import complete, entries, interrupt, is_entry
from harness import LONG, Server


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def start_line(server):
    """The start-up line of the prompt cache."""
    lines = re.findall(r"Prompt cache: memory holds .*", server.log_path.read_text())
    assert len(lines) == 1, server.log()
    return lines[0]


def test_start_line_files_and_models(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hub-cache"))
    model, cache_dir = model_dir("llama"), tmp_path / "made" / "cache"
    flags = ["--prompt-cache-dir", cache_dir, "--prompt-cache-bytes", "2G"]
    flags += ["--prompt-cache-disk-block", 64]  # block files of its prompt

    with Server(model, *flags, log=tmp_path / "first.log") as server:
        models = server.get("/v1/models")
        complete(server)
        entries(cache_dir)
        first = start_line(server)
        interrupt(server)
    log = server.log_path.read_text()
    names = os.listdir(cache_dir)
    with Server(model, *flags, log=tmp_path / "restarted.log") as server:
        again = start_line(server)

    assert [m["id"] for m in models["data"]] == [str(model.resolve())], models
    assert "Traceback" not in log and "CacheNotFound" not in log, log
    assert mode(cache_dir) == 0o700
    assert any(".block." in n for n in names), names  # block files too
    assert {mode(cache_dir / n) for n in names} == {0o600}, names
    assert "disk: 0 entries (0 B) found in" in first, first
    # The budget's count: entries, blocks and what is known (digests, rates)
    found = sum(os.path.getsize(cache_dir / n) for n in os.listdir(cache_dir))
    written = [n for n in names if is_entry(n)]
    assert f"disk: {len(written)} entries ({found} B) found in" in again, again
    for budget in ("10 entries", "2000000000 B", "16000000000 B", "1000000000 B"):
        assert budget in again, again


def test_a_prompt_past_model_max_length_logs_no_indexing_warning(
    make_tiny_dir, tmp_path
):
    model = make_tiny_dir("llama", seed=3)
    config = json.loads((model / "tokenizer_config.json").read_text())
    config["model_max_length"] = 64
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    with Server(model, log=tmp_path / "server.log") as server:
        status, reply = server.post(
            "/v1/completions", {"prompt": LONG, "max_tokens": 2}
        )
    assert status == 200, reply
    assert reply["usage"]["prompt_tokens"] > 64
    assert "indexing errors" not in server.log_path.read_text(), server.log()
