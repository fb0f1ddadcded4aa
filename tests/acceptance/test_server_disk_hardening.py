"""Hardening the disk tier (#25), through ``python -m mlx_lm_patched.server``:
no file in ``--prompt-cache-dir``, no swapped model and no second replica
gives a wrong cache, hangs the server or kills it. Each attack ends in a miss
(``cached_tokens`` 0, the text of a cold run) with a warning naming the
file, or a one-line error; the server answers a valid request afterwards.
"""

import json
import os
import shutil

from cache_dir import entries, interrupt, is_entry
from harness import LONG, MAX_TOKENS, Server, run

SHORTER = " ".join(LONG.split()[:-12])


def header_of(path):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def forge(path, header, body, reseal=True):
    """Write ``header`` and ``body`` as an entry named by the hash of what
    the header claims, its manifest recomputed (``reseal``): a file crafted
    to pass every check a name or a digest can make."""
    from mlx_lm.models.prompt_cache_disk import DiskPromptCache

    meta = header["__metadata__"]
    if reseal:
        meta["0.manifest"] = DiskPromptCache._manifest(header)
    name = DiskPromptCache._name(meta["0.model"], json.loads(meta["0.tokens"]))
    raw = json.dumps(header).encode()
    target = path.parent / name
    target.write_bytes(len(raw).to_bytes(8, "little") + raw + body)
    return target


def post(server, prompt, max_tokens=MAX_TOKENS):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    status, reply = server.post("/v1/completions", body)
    assert status == 200, reply
    details = reply["usage"].get("prompt_tokens_details") or {}
    return reply["choices"][0]["text"], details.get("cached_tokens", 0)


def test_a_hostile_cache_directory_is_skipped_and_the_server_answers(
    model_dir, tmp_path
):
    """gemma3_text: its sliding layers wrap on the long prompt, so a raised
    trim count would have the server trim a ring it cannot."""
    model, cache_dir = model_dir("gemma3_text"), tmp_path / "cache"
    flags = ["--prompt-cache-dir", cache_dir, "--prompt-cache-size", 0]
    with Server(model, *flags, log=tmp_path / "first.log") as server:
        post(server, LONG)
        cold_shorter, cached = post(server, SHORTER)  # past the ring's slack
        assert cached == 0
        entries(cache_dir)  # one written while the server idled
        interrupt(server)  # what waited for an idle server written too
    written = set(entries(cache_dir))
    planted = {}
    for name in written:
        header, body = header_of(cache_dir / name)
        meta = header["__metadata__"]
        if len(json.loads(meta["0.tokens"])) > 100:  # the long prompt's entry
            meta["0.trimmable"] = str(len(json.loads(meta["0.tokens"])))
            (cache_dir / name).write_bytes(
                len(json.dumps(header)).to_bytes(8, "little")
                + json.dumps(header).encode()
                + body
            )
            planted["trim count raised"] = cache_dir / name
            crafted = dict(header, __metadata__=dict(meta, **{"0.tokens": "null"}))
        else:
            os.remove(cache_dir / name)  # the shorter prompt is asked again
    planted["tokens null, named by its hash"] = forge(cache_dir / "x", crafted, body)
    planted["a FIFO"] = cache_dir / ("f" * 32 + ".safetensors")
    os.mkfifo(planted["a FIFO"])
    planted["a link"] = cache_dir / ("1" * 32 + ".safetensors")
    os.symlink(planted["trim count raised"], planted["a link"])
    planted["a 3 GiB header"] = cache_dir / ("2" * 32 + ".safetensors")
    with open(planted["a 3 GiB header"], "wb") as f:
        f.write((3 << 30).to_bytes(8, "little"))
        f.truncate(3 << 30)
    stale = cache_dir / ("3" * 32 + ".safetensors.99999-1.tmp")
    stale.write_bytes(b"\0" * 4096)  # a writer killed mid-write
    os.utime(stale, (1, 1))

    with Server(model, *flags, log=tmp_path / "hostile.log") as server:
        # Served the raised trim count, it would trim the long prompt's
        # wrapped ring past its slack in the generation thread.
        shorter, cached_shorter = post(server, SHORTER)
        post(server, LONG)  # may reuse the shorter prompt's new entry
        healthy = server.get("/health")["status"]
    log = server.log_path.read_text()

    assert healthy == "ok", log
    assert (shorter, cached_shorter) == (cold_shorter, 0), log
    for what, path in planted.items():
        assert f"skipping {path}" in log, f"{what}:\n{log}"
    assert not stale.exists()
    assert "Traceback" not in log, log


def test_other_weights_at_the_model_path_are_a_miss(make_tiny_dir, tmp_path):
    """The same ``--model`` path, new weights with the same config, then a
    model of another head layout: neither is served the old entries."""
    model, cache_dir = tmp_path / "model", tmp_path / "cache"
    shutil.copytree(make_tiny_dir("llama"), model)
    flags = ["--prompt-cache-dir", cache_dir, "--prompt-cache-size", 0]
    with Server(model, *flags, log=tmp_path / "first.log") as server:
        post(server, LONG)
        entries(cache_dir)
        interrupt(server)

    replacements = {
        "new weights": make_tiny_dir("llama", seed=7),
        "other head layout": make_tiny_dir("llama", num_key_value_heads=1),
    }
    for what, source in replacements.items():
        shutil.rmtree(model)
        shutil.copytree(source, model)
        with Server(model, *flags, log=tmp_path / f"{what}.log") as server:
            _, cached = post(server, LONG)
            _, cached_again = post(server, LONG)  # its own entry now
            healthy = server.get("/health")["status"]
            interrupt(server)
        log = server.log_path.read_text()
        assert healthy == "ok" and cached == 0 and cached_again > 0, f"{what}\n{log}"
        assert "Traceback" not in log, log


def test_replicas_on_one_directory_hold_its_budget_together(model_dir, tmp_path):
    model, cache_dir = model_dir("llama"), tmp_path / "cache"
    words = LONG.split()
    prompts = [" ".join(words[i:] + words[:i]) for i in range(0, 60, 10)]
    with Server(model, "--prompt-cache-dir", cache_dir, "--prompt-cache-size", 0,
                log=tmp_path / "probe.log") as server:  # fmt: skip
        post(server, prompts[0], max_tokens=1)
        first = entries(cache_dir)[0]  # the prompt's, or its answer's
        interrupt(server)
    one = os.path.getsize(cache_dir / first)  # and the block files it names
    blocks = header_of(cache_dir / first)[0]["__metadata__"].get("0.blocks")
    for name in json.loads(blocks)["files"] if blocks else []:
        one += os.path.getsize(cache_dir / name)
    budget = 2 * one + one // 2
    flags = ["--prompt-cache-dir", cache_dir, "--prompt-cache-size", 0]
    flags += ["--prompt-cache-disk-bytes", budget]
    logs = [tmp_path / "a.log", tmp_path / "b.log"]
    with (
        Server(model, *flags, log=logs[0]) as a,
        Server(model, *flags, log=logs[1]) as b,
    ):
        for i, prompt in enumerate(prompts):
            post((a, b)[i % 2], prompt, max_tokens=1)
        interrupt(a)
        interrupt(b)

    sizes = [
        os.path.getsize(cache_dir / f)
        for f in os.listdir(cache_dir)
        if f.endswith(".safetensors")
    ]
    text = "".join(p.read_text() for p in logs)
    assert sum(sizes) <= budget, text
    # Two entries at least (a prompt's and its answer's share block files)
    assert len([f for f in os.listdir(cache_dir) if is_entry(f)]) >= 2, text
    assert "could not remove" not in text and "Traceback" not in text, text


BAD_FLAGS = {
    "a negative size": ["--prompt-cache-disk-bytes", "-1"],
    "a word for a size": ["--prompt-cache-disk-bytes", "abc"],
    "an unknown unit": ["--prompt-cache-bytes", "10X"],
    "a file for the directory": ["--prompt-cache-dir", "{file}"],
    "a directory under a file": ["--prompt-cache-dir", "{file}/cache"],
}


def test_bad_flags_end_in_one_line_error(tmp_path, model_dir):
    (tmp_path / "file").write_text("not a directory")
    for what, flags in BAD_FLAGS.items():
        flags = [f.format(file=tmp_path / "file") for f in flags]
        done = run("server", "--model", model_dir("llama"), *flags)
        (error,) = [l for l in done.stderr.splitlines() if "error:" in l]
        assert done.returncode == 2, f"{what}: {done.stderr}"
        assert f"argument {flags[0]}: " in error, f"{what}: {done.stderr}"
        assert "Traceback" not in done.stderr, f"{what}: {done.stderr}"


def test_generate_refuses_a_cache_file_of_another_layout(make_tiny_dir, tmp_path):
    """The cache file names the model's path; the model at that path is
    replaced by one of 2 layers, then one of 1 kv head."""
    model, cache_file = tmp_path / "model", tmp_path / "cache.safetensors"
    shutil.copytree(make_tiny_dir("llama"), model)
    done = run("cache_prompt", "--model", model, "--prompt", LONG,
               "--prompt-cache-file", cache_file)  # fmt: skip
    assert done.returncode == 0, done.stderr
    others = {
        "it has 4 layers, the model 2": make_tiny_dir("llama", num_hidden_layers=2),
        "layer 0 holds (2, 16, 16), the model (1, 16, 16) "
        "(kv heads, key dim, value dim)": make_tiny_dir("llama", num_key_value_heads=1),
    }
    for why, other in others.items():
        shutil.rmtree(model)
        shutil.copytree(other, model)
        done = run("generate", "--model", model, "--prompt-cache-file", cache_file,
                   "--prompt", "more", "--max-tokens", 4)  # fmt: skip
        assert done.returncode == 1, done.stderr
        assert done.stderr.strip().splitlines() == [
            f"mlx_lm_patched.generate: error: {cache_file} does not fit the "
            f"model {model}: {why}"
        ], done.stderr
