"""What entries quantized at rest (``--prompt-cache-bits``) trade, through
``python -m mlx_lm_patched.server`` on the demo model (issue 48).

Eight prompts of ~700 tokens, each sent, then sent again edited past its
512th token: the demo model's sliding layers (window 64) have wrapped, so
the edited prompt branches from the window checkpoint at 512 (restored
from the entry, at rest in bfloat16's place, 8 or 4 bits). Its greedy
answer is compared with a cold server's: bfloat16 entries keep all 8
answers; quantized ones part from some where the demo model has near ties
(how many depends on the model as trained: 8 of 8 at 8 bits with the
packages of an earlier day, 6 of 8 with later ones), so their count goes
to the report and docs/hardening.md ("Quantized entries at rest").
"""

import pytest
from harness import REPORT, WORDS, Server

from mlx_lm_patched.demo import tiny, tiny_train

CASES = 8
MAX_TOKENS = 16


def prompts(i):
    """The ``i``-th prompt and its edit: the same start (its own from the
    first token, so no two cases share a prefix), the end changed past the
    512th token."""
    start = f"Note {i}: {tiny.TEXT}"
    tail = WORDS[20 * i : 20 * i + 60]
    edited = tail[:20] + ["an", "edited", "line"] + tail[30:]
    return f"{start} {' '.join(tail)}", f"{start} {' '.join(edited)}"


def answer(server, prompt):
    """``(greedy text, cached tokens)``."""
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    status, reply = server.post("/v1/completions", body, timeout=300)
    assert status == 200, reply
    details = reply["usage"].get("prompt_tokens_details") or {}
    return reply["choices"][0]["text"], details.get("cached_tokens", 0)


@pytest.fixture(scope="module")
def demo_model():
    return tiny_train.demo_model_dir()


@pytest.fixture(scope="module")
def cold(demo_model, tmp_path_factory):
    """Each edited prompt's answer from a server that has seen nothing like it."""
    log = tmp_path_factory.mktemp("cold") / "cold.log"
    with Server(demo_model, log=log) as server:
        answers = [answer(server, prompts(i)[1]) for i in range(CASES)]
    assert all(cached == 0 for _, cached in answers)
    return [text for text, _ in answers]


def branched(demo_model, log, *flags):
    """Each edited prompt's answer after its original, and the tokens cached
    (the original's entries at rest by then: the last request's are put at
    rest by the next request's insert, a short one between)."""
    with Server(demo_model, *flags, log=log) as server:
        out = []
        for i in range(CASES):
            first, edited = prompts(i)
            answer(server, first)
            answer(server, f"Unrelated {i}.")
            out.append(answer(server, edited))
    return out


@pytest.mark.parametrize("bits", [None, 8, 4], ids=["bf16", "8-bit", "4-bit"])
def test_branch_answers_from_entries_at_rest_against_a_cold_server(
    demo_model, cold, tmp_path, bits
):
    flags = [] if bits is None else ["--prompt-cache-bits", bits]
    out = branched(demo_model, tmp_path / "server.log", *flags)
    assert all(cached == 512 for _, cached in out), out  # from the checkpoint
    same = sum(text == ref for (text, _), ref in zip(out, cold))
    name = "entries in full precision" if bits is None else f"{bits}-bit entries"
    REPORT.append(
        f"branch from a checkpoint, {name}: {same} of {CASES} greedy answers "
        f"({MAX_TOKENS} tokens) equal to a cold server's"
    )
    if bits is None:  # quantized entries part from some: measured, not promised
        assert same == CASES, [(t, r) for (t, _), r in zip(out, cold) if t != r]
