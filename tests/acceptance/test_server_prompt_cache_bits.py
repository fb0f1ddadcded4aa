"""``python -m mlx_lm_patched.server --prompt-cache-bits {4,8}``: the prompt
cache keeps its entries quantized at rest, in memory and in
``--prompt-cache-dir``, and a repeated prompt is still a hit; and
``--kv-bits`` on a sliding-window model (gemma3_text, window 64) reuses a
prompt whose end was re-rendered, as bfloat16 rings do (the quantized ring
steps back within its slack).
"""

import re
import time

from cache_dir import complete, entries, interrupt, load_entry
from harness import LONG, OTHER_LONG, SHORT, SLACK, WORDS, Server


def bytes_at_rest(server, seconds=60):
    """The prompt cache's bytes the server logged once idle after its last
    request, its entries at rest."""
    deadline = time.monotonic() + seconds
    while True:
        log = server.log_path.read_text()
        since = log[log.rindex("Prompt Cache: ") :]  # the last request's start
        sizes = re.findall(r"at rest: .*\((\d+) B\)", since)
        if sizes:
            return int(sizes[-1])
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)


def test_a_repeated_prompt_hits_entries_kept_quantized_at_rest(make_tiny_dir, tmp_path):
    # bfloat16, head dim 64: one quantization group a token and head.
    model = make_tiny_dir("gemma3_text", dtype="bfloat16", head_dim=64)
    served = {}
    for name, flags in (("bf16", []), ("8-bit", ["--prompt-cache-bits", 8])):
        with Server(model, *flags, log=tmp_path / f"{name}.log") as server:
            _, cached, prompt_tokens = complete(server)
            _, cached_again, _ = complete(server)
            served[name] = (cached, cached_again, bytes_at_rest(server))
    for cached, cached_again, _ in served.values():
        assert (cached, cached_again) == (0, prompt_tokens - 1)
    # Kept as computed for a next request, the entries rest once the server
    # idles: quantized, the prompt's and the answer's take at most 0.6x.
    assert 0 < served["8-bit"][2] <= 0.6 * served["bf16"][2]


def test_entries_quantized_on_disk_are_hit_after_a_restart(make_tiny_dir, tmp_path):

    model = make_tiny_dir("gemma3_text", dtype="bfloat16", head_dim=64)
    cache_dir = tmp_path / "cache"
    # Size 0: every entry goes to the directory as soon as it is stored.
    flags = ["--prompt-cache-bits", 4, "--prompt-cache-dir", cache_dir]
    flags += ["--prompt-cache-size", 0]

    with Server(model, *flags, log=tmp_path / "first.log") as server:
        _, cached, prompt_tokens = complete(server)
        written = entries(cache_dir)
        interrupt(server)
    with Server(model, *flags, log=tmp_path / "restarted.log") as server:
        _, cached_again, _ = complete(server)

    assert cached == 0 and cached_again == prompt_tokens - 1, server.log()
    for name in written:
        cache = load_entry(cache_dir, name)
        kinds = {type(c).__name__ for c in cache}
        assert kinds == {"QuantizedRotatingKVCache", "QuantizedKVCache"}
        assert {c.bits for c in cache} == {4}


def re_rendered(text):
    """``text`` with its last word changed, as a client re-renders an end."""
    return text.rsplit(" ", 1)[0] + " " + WORDS[3]


def test_kv_bits_on_a_sliding_model_reuses_a_re_rendered_prompt(model_dir, tmp_path):
    # Prompts longer than the window (wrapped rings), served one at a time;
    # round 2 sends them at once with their last word changed: a hit trims
    # the stored quantized rings back past the changed tokens, within the
    # slack, as bfloat16 rings do. (Prompts prefilled together, right padded,
    # keep no evicted tokens, bfloat16 or quantized: see batch_rotating_prealloc.)
    import threading

    prompts = [LONG, OTHER_LONG, " ".join([SHORT] * 4)]
    flags = ["--kv-bits", 4, "--quantized-kv-start", 0, "--prompt-cache-size", 64]
    second = [None] * len(prompts)

    def ask(server, text, out, i):
        body = {"prompt": text, "max_tokens": 4, "temperature": 0}
        status, reply = server.post("/v1/completions", body)
        assert status == 200, reply
        out[i] = reply["usage"]

    with Server(model_dir("gemma3_text"), *flags, log=tmp_path / "s.log") as server:
        first = [None] * len(prompts)
        for i, text in enumerate(prompts):
            ask(server, text, first, i)
        threads = [
            threading.Thread(target=ask, args=(server, re_rendered(p), second, i))
            for i, p in enumerate(prompts)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert None not in second, server.log()
    for usage in first:
        assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    for usage in second:
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        # More than a window reused; at most the slack and the new word prefilled.
        assert cached >= usage["prompt_tokens"] - SLACK, (usage, server.log())
