"""``python -m mlx_lm_patched.server --max-kv-size 64`` on the demo model
(a sliding layer of window 64 and a full-attention layer): every
conversation's cache is a ring of 64 tokens, as ``generate --max-kv-size
64`` makes it. Concurrent requests (batched) and a request served alone
answer as ``generate`` does with the same ring, also with ``--kv-bits 8``; the prompt cache holds rings
(its bytes stay under 64 tokens an entry); a repeated conversation is a
hit, from memory and from ``--prompt-cache-dir`` after a restart.
"""

import re
import threading

import pytest
from cache_dir import entries, interrupt, load_entry
from harness import LONG, OTHER_LONG, SLACK, WORDS, Server, generate, text_of

from mlx_lm_patched.demo import tiny_train

RING = 64
# Prompts of 172 to 277 tokens: past the ring.
PROMPTS = [LONG, OTHER_LONG, " ".join(WORDS[100:250])]
# Served alone (a request with a seed is not batched).
ALONE = " ".join(WORDS[150:300])
MAX_TOKENS = 16
KV8 = ["--kv-bits", 8, "--quantized-kv-start", 0]


@pytest.fixture(scope="module")
def demo():
    return tiny_train.demo_model_dir()


def chat(server, text, **extra):
    """``(answer, cached tokens, prompt tokens)`` of a greedy one-message chat."""
    body = {"messages": [{"role": "user", "content": text}], "temperature": 0}
    body.update(extra)
    status, reply = server.post(
        "/v1/chat/completions", {**body, "max_tokens": MAX_TOKENS}
    )
    assert status == 200, reply
    usage = reply["usage"]
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return reply["choices"][0]["message"]["content"], cached, usage["prompt_tokens"]


def chat_at_once(server, texts):
    """``chat`` of every text, sent together (the server batches them)."""
    replies = [None] * len(texts)

    def ask(i):
        replies[i] = chat(server, texts[i])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(texts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return replies


def logged_cache(server):
    """``(sequences, bytes)`` of the prompt cache the server last logged."""
    found = re.findall(
        r"Prompt Cache: (\d+) sequences, .*\((\d+) B\)", server.log_path.read_text()
    )
    assert found, server.log()
    return tuple(map(int, found[-1]))


def token_bytes(model):
    """Bytes of K and V one token takes in every layer of ``model`` (float32)."""
    import json

    config = json.loads((model / "config.json").read_text())
    layers, heads = config["num_hidden_layers"], config["num_key_value_heads"]
    return 2 * layers * heads * config["head_dim"] * 4


@pytest.mark.parametrize("kind", ["float32", "kv8"])
def test_concurrent_requests_answer_as_generate_with_the_same_ring(
    kind, demo, tmp_path
):
    kv = KV8 if kind == "kv8" else []
    flags = ["--max-kv-size", RING, *kv]
    # No window checkpoints: a batch takes them on its own timeline, so a
    # prompt joining a running one can keep a window before 512 of its own
    # tokens (rotating_prealloc), and the bound below is the rings alone.
    served = [*flags, "--prompt-cache-checkpoint-every", 0]
    with Server(demo, *served, log=tmp_path / "server.log") as server:
        replies = chat_at_once(server, PROMPTS)
        again = chat(server, PROMPTS[0])  # logs what the first ones left
        sequences, nbytes = logged_cache(server)
        alone = chat(server, ALONE, seed=0)

    for text, (answer, cached, prompt_tokens) in zip(
        PROMPTS + [ALONE], replies + [alone]
    ):
        assert cached == 0 and prompt_tokens > 2 * RING
        want = text_of(generate(demo, text, *flags, max_tokens=MAX_TOKENS))
        assert answer == want, server.log()
    assert again[0] == replies[0][0] and again[1] == replies[0][2] - 1, server.log()
    # Every entry is a ring, whatever its prompt (172 to 277 tokens): 64
    # tokens a layer and an undo ring of 2 * SLACK (rotating_prealloc).
    ring = (RING + 2 * SLACK) * token_bytes(demo)
    assert 0 < sequences and nbytes <= sequences * ring


def test_rings_on_disk_are_hit_after_a_restart(demo, tmp_path):
    cache_dir = tmp_path / "cache"
    flags = ["--max-kv-size", RING, *KV8, "--prompt-cache-dir", cache_dir]

    with Server(demo, *flags, log=tmp_path / "first.log") as server:
        first = chat_at_once(server, PROMPTS[:2])
        written = entries(cache_dir)
        interrupt(server)
    with Server(demo, *flags, log=tmp_path / "restarted.log") as server:
        again = chat(server, PROMPTS[0])

    assert again[0] == first[0][0] and again[1] == first[0][2] - 1, server.log()
    for name in written:
        kinds = {type(c).__name__ for c in load_entry(cache_dir, name)}
        assert kinds == {"QuantizedRotatingKVCache"}, name
