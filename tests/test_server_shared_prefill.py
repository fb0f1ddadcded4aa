"""server_shared_prefill: a request sharing a long prefix with a request
still prefilling waits for its stored segments instead of prefilling the
prefix again."""

import threading

import pytest
from ringref import cli_args, generation_args

import mlx_lm_patched


def serve_together(make_tiny_dir, monkeypatch, chats, max_tokens=3, events=None):
    """Each chat's (cached tokens, tokens), all queued before the server's
    generation thread takes the first; ``events``: the prompt cache's
    inserts (their types) and hits (``"hit"``), in order."""
    from mlx_lm.models.cache import LRUPromptCache
    from mlx_lm.server import CompletionRequest, ModelProvider, ResponseGenerator

    events = [] if events is None else events

    class Recording(LRUPromptCache):
        def insert_cache(self, model, tokens, cache, *, cache_type="assistant"):
            events.append(cache_type)
            super().insert_cache(model, tokens, cache, cache_type=cache_type)

        def fetch_nearest_cache(self, model, tokens):
            cache, rest = super().fetch_nearest_cache(model, tokens)
            events.extend(["hit"] if cache is not None else [])
            return cache, rest

    gate, load = threading.Event(), ModelProvider.load_default
    monkeypatch.setattr(
        ModelProvider, "load_default", lambda self: (gate.wait(60), load(self))
    )
    args = cli_args(make_tiny_dir("llama"))
    args.warmup_tokens = 0  # its prompt cache's inserts only
    generator = ResponseGenerator(ModelProvider(args), Recording())
    out = [None] * len(chats)

    def ask(i):
        request = CompletionRequest("chat", "", chats[i], None, None)
        ctx, responses = generator.generate(request, generation_args(max_tokens))
        out[i] = (ctx.prompt_cache_count, [r.token for r in responses])

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(chats))]
    try:
        for t in threads:
            t.start()
        while generator.requests.qsize() < len(chats):
            threading.Event().wait(0.01)
        gate.set()
        for t in threads:
            t.join(120)
    finally:
        generator.stop_and_join()
    return out


@pytest.mark.parametrize("patch", [True, False])
def test_chats_that_come_together_prefill_their_system_prompt_once(
    patched, make_tiny_dir, monkeypatch, patch
):
    """Four chats behind one 1,000-token system prompt, queued together: one
    prefills the system prompt, the other three find it cached (upstream:
    every one prefills it), stored once the first's prefill ends it, before
    the first's own segment (they prefill beside its rest), and each
    answers as it does alone."""
    if not patch:
        mlx_lm_patched.revert("server_shared_prefill")
    system = {"role": "system", "content": "You answer in one word. " * 200}
    chats = [[system, {"role": "user", "content": f"Why {i}?"}] for i in range(4)]
    events = []
    together = serve_together(make_tiny_dir, monkeypatch, chats, events=events)
    cached = sorted(c for c, _ in together)
    assert cached == ([0] + [cached[-1]] * 3 if patch else [0] * 4)
    assert cached[-1] >= 1000 or not patch
    if patch:
        assert events[:5] == ["system", "hit", "hit", "hit", "user"]
    alone = [serve_together(make_tiny_dir, monkeypatch, [c])[0] for c in chats]
    assert [t for _, t in together] == [t for _, t in alone]


def test_a_request_waits_for_a_long_prefix_the_other_stores():
    """A wait is for at least SHARED_PREFILL_TOKENS that the other request
    stores at a segment's end past what it found cached, and for at least
    half of what it prefills."""
    from mlx_lm.server import SHARED_PREFILL_TOKENS, _waits_for

    n = SHARED_PREFILL_TOKENS
    prompt = list(range(3 * n))
    other = prompt[: 2 * n] + [-1] * n
    assert _waits_for(prompt, {7: (other, [0, 2 * n], [])}) == 7
    # its segment ends past the shared tokens: nothing stored to find
    assert _waits_for(prompt, {7: (other, [0, 2 * n + 1], [])}) is None
    # what it found cached the request finds too
    assert _waits_for(prompt, {7: (other, [n + 1, 2 * n], [])}) is None
    # the shared tokens are less than half of what the other prefills
    longer = prompt[: 2 * n] + [-1] * (2 * n + 1)
    assert _waits_for(prompt, {7: (longer, [0, 2 * n], [])}) is None
    assert _waits_for(prompt, {}) is None
