"""The server's prompt cache holds ``--prompt-cache-bytes``.

Upstream's ``run`` builds ``LRUPromptCache(prompt_cache_size)`` with no byte
limit, and ``_generate`` trims it only when a request joins the batch: the
caches inserted at the ends of segments and requests, and every request
served one at a time (``_serve_single``), grow it past the budget
(ml-explore/mlx-lm#1390, #1807). Here ``run`` gives the prompt cache
``max_bytes``, so every insert evicts down to the budget on every path; the
batched path also trims after every batch step to the budget less what the
running batch holds (``server_kv_bits``'s ``_generate``).
"""

from http.server import ThreadingHTTPServer

from mlx_lm.server import APIHandler, ModelProvider

from ._registry import Patch, Target, pasted_into


# Written as it reads in mlx_lm/server.py, and runs there.
def run(
    host: str,
    port: int,
    model_provider: ModelProvider,
    server_class=ThreadingHTTPServer,
    handler_class=APIHandler,
):
    group = mx.distributed.init()
    cli_args = model_provider.cli_args
    prompt_cache = LRUPromptCache(cli_args.prompt_cache_size)
    if cli_args.prompt_cache_bytes is not None:
        prompt_cache.max_bytes = cli_args.prompt_cache_bytes
    response_generator = ResponseGenerator(model_provider, prompt_cache)
    if group.rank() == 0:
        _run_http_server(host, port, response_generator)
    else:
        response_generator.join()


PATCH = Patch(
    "server_prompt_cache",
    "server: --prompt-cache-bytes holds on every insert and after every batch step",
    [Target("mlx_lm.server", "run", pasted_into("mlx_lm.server", run), "8f50bb2caad4")],
    requires=("prompt_cache_store",),
    uses={
        "mlx_lm.server": (
            "LRUPromptCache",
            "ResponseGenerator",
            "_run_http_server",
            "mx",
        )
    },
)
