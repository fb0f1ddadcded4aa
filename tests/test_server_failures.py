"""A request that fails in a batch step fails alone: the generation thread
and the other requests of its batch go on (server_failures' edit of
``_generate``).

The HTTP handler refuses what it can check (tests/acceptance/
test_server_requests.py); these requests bypass it, as one for a model still
loading does, and reach the real generation thread of a real tiny model.
"""

import logging
import threading

import pytest
from ringref import cli_args, generation_args


@pytest.fixture
def generator(patched, make_tiny_dir):
    from mlx_lm.models.cache import LRUPromptCache
    from mlx_lm.server import ModelProvider, ResponseGenerator

    provider = ModelProvider(cli_args(make_tiny_dir("llama")))
    generator = ResponseGenerator(provider, LRUPromptCache())
    yield generator
    generator.stop_and_join()


def completion(generator, args, out, started=None):
    """Run one request to its end: its tokens, or the exception it raised."""
    from mlx_lm.server import CompletionRequest

    request = CompletionRequest("text", "The key and value cache", [], None, None)
    try:
        ctx, responses = generator.generate(request, args)
        tokens = []
        for r in responses:
            tokens.append(r.token)
            if started is not None:
                started.set()
        out.append(tokens)
    except Exception as e:
        out.append(e)
    finally:
        if started is not None:
            started.set()


@pytest.mark.parametrize(
    "bad",
    [
        {"logit_bias": {512: 5.0}},  # the vocabulary is 512
        {"temperature": 1.0, "top_k": 10**9},
    ],
    ids=["logit_bias", "top_k"],
)
def test_a_request_failing_in_a_batch_step_leaves_its_batch_going(
    generator, bad, caplog
):
    good, failed, started = [], [], threading.Event()
    first = threading.Thread(
        target=completion, args=(generator, generation_args(300), good, started)
    )
    first.start()
    assert started.wait(120)  # generating: the bad request joins its batch
    with caplog.at_level(logging.INFO):
        completion(generator, generation_args(4, **bad), failed)
    first.join(120)
    assert isinstance(failed[0], ValueError), failed
    assert isinstance(good[0], list) and len(good[0]) > 0
    assert generator.generation_available()
    assert "requests failed" not in caplog.text  # the thread was not restarted
    after = []
    completion(generator, generation_args(4), after)
    assert len(after[0]) == 4


def test_a_failing_generation_thread_fails_the_requests_it_held_and_goes_on(
    generator, caplog
):
    """An empty prompt fails outside any request's sampler: the thread runs
    again, that request gets the error, the next is served."""
    from mlx_lm.server import CompletionRequest

    with caplog.at_level(logging.INFO):
        request = CompletionRequest("text", "", [], None, None)
        with pytest.raises(Exception):
            _, responses = generator.generate(request, generation_args(4))
            list(responses)
    assert "requests failed" in caplog.text  # run again
    assert generator.generation_available()
    after = []
    completion(generator, generation_args(4), after)
    assert len(after[0]) == 4
