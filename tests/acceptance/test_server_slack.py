"""A multi-turn chat through ``python -m mlx_lm_patched.server`` on a model
with sliding layers (gemma3_text, window 64): each turn sends back the
previous answer with its end altered, as clients re-render it. The patched
server trims the previous turn's cache back over the altered tail (its rings
hold ``SLACK`` evicted tokens) and prefills only the new turn; upstream's
wrapped rings cannot be trimmed (ml-explore/mlx-lm#980), so it prefills the
whole conversation every turn. Greedy answers are the same.
"""

from harness import LONG, OTHER_LONG, OTHER_SHORT, REPORT, SHORT, SLACK, Server
from tokenizers import Tokenizer

from mlx_lm_patched.demo import tiny

USERS = [LONG, OTHER_SHORT, SHORT, OTHER_LONG]


def words():
    """``logit_bias`` keeping answers to whole words of one token each, so
    an answer's text encodes back to the tokens generated (a random model's
    bytes would not), as a real model's answers do."""
    tokenizer = Tokenizer.from_str(tiny.tokenizer_json())
    ids = [tokenizer.encode(" " + w).ids for w in set(tiny.TEXT.split())]
    return {str(i[0]): 100.0 for i in ids if len(i) == 1}


def chat(server):
    """Per turn: (prompt tokens, prefilled tokens, answer)."""
    messages, turns, bias = [], [], words()
    for text in USERS:
        messages.append({"role": "user", "content": text})
        body = {"messages": messages, "max_tokens": 24, "temperature": 0}
        body["logit_bias"] = bias
        status, reply = server.post("/v1/chat/completions", body)
        assert status == 200, reply
        usage = reply["usage"]
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        answer = reply["choices"][0]["message"]["content"]
        turns.append((usage["prompt_tokens"], usage["prompt_tokens"] - cached, answer))
        # The client re-renders the answer: its last word changed. (The
        # detokenizer drops the first word's space: put back, the text
        # encodes to the tokens generated up to there.)
        answer = " " + answer.rsplit(" ", 1)[0] + " ."
        messages.append({"role": "assistant", "content": answer})
    return turns


def test_each_turn_prefills_only_the_new_turn_where_upstream_prefills_all(
    model_dir, tmp_path
):
    model = model_dir("gemma3_text")
    with Server(model, log=tmp_path / "patched.log") as s:
        patched = chat(s)
    with Server(model, log=tmp_path / "upstream.log", upstream=True) as s:
        upstream = chat(s)
    REPORT.append(
        "server chat, gemma3_text window 64, prefilled tokens per turn "
        f"(of the prompt's): patched {[(p, t) for t, p, _ in patched]}, "
        f"upstream {[(p, t) for t, p, _ in upstream]}"
    )
    assert [a for *_, a in patched] == [a for *_, a in upstream]
    for (total, prefilled, _), (_, again, _) in zip(patched[1:], upstream[1:]):
        # Upstream reuses the previous prompt (a cache stored at its end) and
        # prefills the previous answer again; patched, the answer is reused
        # but for the re-rendered tail: the new turn is all it prefills.
        assert prefilled <= again - 24 + SLACK
