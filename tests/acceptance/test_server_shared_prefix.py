"""``python -m mlx_lm_patched.server``: 16 concurrent chats behind one
4,000-token system prompt keep the prefix once (issue #28).

One chat warms the prompt cache, then 16 chats with the same system prompt
and a question each come at once. Each is a prompt-cache hit for the whole
system prompt (``cached_tokens``), and the prompt cache the server logs
before every request holds its 17 conversations within one prefix plus the
tails: the prefix's blocks once (``prompt_cache_blocks``), each
conversation its own tokens (its question, the reply, and the system
prompt's tokens past its last whole block).

``--prompt-cache-bytes`` counts the running batch too (upstream's flag: the
server trims its prompt cache to the budget less what the batch holds), and
a batch holds every chat's prefix in its own rows while it runs, so the flag
is that bound plus room for the 16 rows. Stored whole, the 17 entries fit
under the flag but log 17 prefixes, far over the bound. The prompt cache
keeps at most ``whole_entries`` (3) entries whole until a later request
(``prompt_cache_store``: the next request of a conversation takes them as
computed): the bound holds those three whole prompts more.
"""

import re
import threading

from harness import LLAMA_TOKEN_BYTES, REPORT, WORDS, Server, system_chat

CHATS = 16
SYSTEM = " ".join((WORDS * 8)[:2300])  # 4,097 tokens on the tiny tokenizer
# One prefix plus the tails: 4,200 tokens for the system prompt (template
# included) and per conversation 64 tokens of its last partial block and 64
# of its own (question, template, reply).
HELD = LLAMA_TOKEN_BYTES * (4200 + (CHATS + 1) * 128)
WHOLE = LLAMA_TOKEN_BYTES * 3 * (4200 + 128)  # three entries not at rest yet
BATCH = LLAMA_TOKEN_BYTES * CHATS * 4608  # the 16 running rows, in 256-token steps
LOGGED = re.compile(r"Prompt Cache: (\d+) sequences, [\d.]+ GB \((\d+) B\)")


def chat(server, i, out):
    out[i] = server.post("/v1/chat/completions", system_chat(SYSTEM, i, 4))


def chats_at_once(server, n, out):
    """Chats 0..n-1 sent at once; their cached tokens, in order."""
    threads = [threading.Thread(target=chat, args=(server, i, out)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    usage = [out[i][1]["usage"] for i in range(n)]
    return [u.get("prompt_tokens_details", {}).get("cached_tokens", 0) for u in usage]


def test_concurrent_chats_share_the_system_prompt_within_the_budget(
    model_dir, tmp_path
):
    flags = ["--prompt-cache-bytes", HELD + BATCH, "--prompt-cache-size", 100]
    replies = {}
    with Server(model_dir("llama"), *flags, log=tmp_path / "server.log") as s:
        chat(s, CHATS, replies)  # warms the prompt cache
        cached = chats_at_once(s, CHATS, replies)
        chat(s, CHATS + 1, replies)  # logs the prompt cache the 16 left
    assert [replies[i][0] for i in range(CHATS + 2)] == [200] * (CHATS + 2)
    logged = [(int(n), int(b)) for n, b in LOGGED.findall(s.log_path.read_text())]
    REPORT.append(
        f"server shared prefix: {CHATS} chats, cached_tokens {cached}, "
        f"logged (sequences, bytes) last {logged[-1]}, max bytes "
        f"{max(b for _, b in logged)} (one prefix plus the tails {HELD}, "
        f"and three entries whole {WHOLE})"
    )
    assert min(cached) >= 4097  # the whole system prompt
    assert logged[-1][0] >= CHATS + 1  # every conversation kept
    assert max(b for _, b in logged) <= HELD + WHOLE


def test_chats_that_come_at_once_to_a_fresh_server_prefill_the_prompt_once(
    model_dir, tmp_path
):
    """8 chats behind the system prompt sent at once to a fresh server (its
    prompt cache empty): one prefills the system prompt, the other 7 wait
    for it and find it cached (``server_shared_prefill``; upstream's server
    prefills it 8 times)."""
    chats, replies = 8, {}
    with Server(model_dir("llama"), log=tmp_path / "server.log") as s:
        cached = chats_at_once(s, chats, replies)
    assert [replies[i][0] for i in range(chats)] == [200] * chats
    REPORT.append(f"server shared prefix, a fresh server: cached_tokens {cached}")
    assert sorted(cached)[0] == 0 and min(sorted(cached)[1:]) >= 4097
