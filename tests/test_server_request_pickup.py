"""server_request_pickup: a request queued while the batch decodes is taken
at the next step, not after the batch's 0.5 s time budget."""

import threading

import pytest
from ringref import cli_args, generation_args

import mlx_lm_patched


@pytest.mark.parametrize("patch", [True, False])
def test_a_request_sent_while_another_decodes_is_taken_at_the_next_step(
    patched, make_tiny_dir, patch
):
    """A request queued during the first step of a time budget is inserted
    after that step (upstream: once the budget's 0.5 s are spent, dozens
    of a tiny model's steps later)."""
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import LRUPromptCache
    from mlx_lm.server import (
        CompletionRequest,
        ModelProvider,
        ResponseGenerator,
        TimeBudget,
    )

    if not patch:
        mlx_lm_patched.revert("server_shared_prefill", "server_request_pickup")
    steps, window, sent, inserts = [0], [None], [None], []
    args = cli_args(make_tiny_dir("llama"))
    args.warmup_tokens = 0  # the server's batch steps only
    generator = ResponseGenerator(ModelProvider(args), LRUPromptCache())

    def ask(max_tokens):
        request = CompletionRequest("text", "Count with me: one two", [], None, None)
        return generator.generate(request, generation_args(max_tokens))

    class Budget(TimeBudget):
        def __iter__(self):
            window[0] = steps[0]  # a budget starts at this step
            return super().__iter__()

    class Counted(BatchGenerator):
        def next(self):
            if sent[0] is None and steps[0] >= 20 and steps[0] == window[0]:
                sent[0] = steps[0]
                threading.Thread(target=ask, args=(2,)).start()
                while generator.requests.empty():  # queued during this step
                    threading.Event().wait(0.001)
            steps[0] += 1
            return super().next()

        def insert_segments(self, *args, **kwargs):
            inserts.append(steps[0])
            return super().insert_segments(*args, **kwargs)

    generator._time_budget = Budget()
    import mlx_lm.server as server

    server.BatchGenerator, real = Counted, server.BatchGenerator
    try:
        _, responses = ask(3000)
        for _ in responses:
            if len(inserts) == 2:
                break
    finally:
        server.BatchGenerator = real
        generator.stop_and_join()
    assert len(inserts) == 2
    waited = inserts[1] - sent[0]
    assert waited == 1 if patch else waited > 5
