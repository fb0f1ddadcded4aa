"""Window checkpoints through ``python -m mlx_lm_patched.server`` on
127.0.0.1 (tiny gemma3_text, window 256, a checkpoint every 512 tokens): a
chat whose long message is edited past the window is regenerated from the
checkpoint before the edit (``cached_tokens`` 512, the rest prefilled), with
a cold server's greedy tokens, also where the checkpoint went through what
used to lose it: entries kept at 8 bits (``--prompt-cache-bits 8``), a
restart reading ``--prompt-cache-dir``, and a batch the request joined
while another decoded.
"""

import re
import signal
import threading
import time

import pytest
from harness import WORDS, Server

FIRST = " ".join(WORDS)  # about 590 tokens
EDITED = " ".join(WORDS[:280] + ["Edited", "here."] + WORDS[290:])  # at ~530


@pytest.fixture(scope="module")
def model(make_tiny_dir):
    return make_tiny_dir("gemma3_text", sliding_window=256)


def chat(server, text, max_tokens=8, *turns):
    """``(greedy text, cached tokens, prompt tokens)`` of a chat whose first
    message is ``text``, then ``turns`` (answer, message, ...)."""
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": text},
    ] + [
        {"role": ("assistant", "user")[i % 2], "content": t}
        for i, t in enumerate(turns)
    ]
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0}
    status, reply = server.post("/v1/chat/completions", body, timeout=300)
    assert status == 200, reply
    usage = reply["usage"]
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return reply["choices"][0]["message"]["content"], cached, usage["prompt_tokens"]


@pytest.fixture(scope="module")
def cold(model, tmp_path_factory):
    """The edited chat's answer from a server that has seen nothing."""
    log = tmp_path_factory.mktemp("cold") / "cold.log"
    with Server(model, log=log) as server:
        text, cached, prompt_tokens = chat(server, EDITED)
    assert cached == 0
    return text, prompt_tokens


def test_entries_at_8_bits_branch_from_their_quantized_checkpoint(
    model, cold, tmp_path
):
    """Only the tokens past the checkpoint are prefilled. The answer is not
    compared: restored from 8 bits, the tiny model's near ties part from a
    cold server's at its sixth token (unit tests compare the logits with
    those of the same tokens at rest at 8 bits: equal)."""
    with Server(model, "--prompt-cache-bits", 8, log=tmp_path / "s.log") as server:
        chat(server, FIRST)
        _, cached, prompt_tokens = chat(server, EDITED)
    assert prompt_tokens == cold[1]
    assert cached == 512, server.log()
    log = server.log_path.read_text()
    totals = re.findall(r"Prompt processing progress: \d+/(\d+)", log)
    assert totals[-1] == str(prompt_tokens - 512)


def test_a_restarted_server_branches_from_the_checkpoint_on_disk(model, cold, tmp_path):
    flags = ["--prompt-cache-dir", tmp_path / "cache"]
    with Server(model, *flags, log=tmp_path / "first.log") as server:
        chat(server, FIRST)
        server.proc.send_signal(signal.SIGTERM)  # drains the write queue
        assert server.proc.wait(timeout=60) == 0, server.log()
    with Server(model, *flags, log=tmp_path / "restarted.log") as server:
        text, cached, prompt_tokens = chat(server, EDITED)
    assert (text, prompt_tokens) == cold
    assert cached == 512
    assert f"Prompt cache disk hit: 512 of {prompt_tokens}" in server.log()


def complete(server, prompt, max_tokens):
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    assert server.post("/v1/completions", body, timeout=300)[0] == 200


def test_a_chat_batched_beside_others_keeps_its_checkpoints(model, cold, tmp_path):
    """A chat's first turn is prefilled while another request decodes (its
    rows join the running batch: ``extend``), its second turn, fetched from
    the first's entry, beside another again (``merge``); the server keeps
    only the second turn's two entries. The edit of the first message
    branches from a checkpoint only those entries carried."""
    other = " ".join(WORDS[:40])  # about 540 tokens of answer: decodes 4 s
    flags = ["--prompt-cache-size", 2]
    with Server(model, *flags, log=tmp_path / "s.log") as server:

        def beside(max_tokens):
            thread = threading.Thread(target=complete, args=(server, other, max_tokens))
            thread.start()
            time.sleep(0.5)  # decoding when the chat comes
            return thread

        thread = beside(2000)
        answer, _, _ = chat(server, FIRST)
        assert thread.is_alive()  # it decoded all along
        thread = beside(2000)
        _, cached, _ = chat(server, FIRST, 8, answer, "And then?")
        assert thread.is_alive() and cached > 512
        text, cached, prompt_tokens = chat(server, EDITED)
        thread.join(timeout=300)
    assert (text, prompt_tokens) == cold
    assert cached == 512, server.log()
