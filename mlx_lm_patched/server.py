"""Drop-in for ``mlx_lm.server``: same flags and output, patched caches.

Its rotating caches (sliding-window layers, ``--max-kv-size``) step back
``--prompt-cache-slack`` tokens exactly after a wrap: a chat whose client
re-renders the end of the previous answer differently still reuses the
previous turn's cache (see ``rotating_prealloc``), where upstream prefills
it all again. They keep a checkpoint of their window every
``--prompt-cache-checkpoint-every`` tokens of a prompt (see
``rotating_prealloc``): a request that branches off a cached prompt past the
window (an edited message) prefills from the nearest checkpoint before the
branch, not from the start. The server passes both to ``make_prompt_cache``.

Stopped (SIGTERM, Ctrl-C), once upstream's ``main`` has returned (its
generation thread joined, its prompt cache written), the process ends there,
exit 0, its log flushed. Left to the interpreter's finalization, MLX aborted
at times ("terminate called without an active exception", exit -6, with the
main thread alone: 2 of 14 stops on a loaded 2-core CPU, upstream's server
too); collecting the reference cycles first still left 2 of 4 stops aborting
on a busier machine.
"""

import argparse
import logging
import os
import sys

from mlx_lm_patched._front import run


def checked_main():
    """Upstream's ``main``, after the checks ``generate`` makes at its first
    model call: the server batches with --kv-bits, and a value mx.quantize
    cannot take would end its generation thread at the first request."""
    from mlx_lm.generate import maybe_quantize_kv_cache
    from mlx_lm.server import main as upstream_main

    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--kv-bits", type=int)
    parser.add_argument("--kv-group-size", type=int, default=64)
    try:
        args = parser.parse_known_args()[0]
    except argparse.ArgumentError:
        pass  # not a number: upstream's parser says so
    else:
        # With no caches to quantize, only the check runs.
        maybe_quantize_kv_cache([], 0, args.kv_group_size, args.kv_bits)
    # A prompt past the tokenizer's model_max_length is no "indexing error"
    # here (rotary positions; --max-kv-size rings): no such warning.
    logging.getLogger("transformers.tokenization_utils_base").addFilter(
        lambda record: "indexing errors" not in record.getMessage()
    )
    upstream_main()
    # MLX can abort in the interpreter's finalization ("terminate called
    # without an active exception", exit -6) after a stop under load, a
    # generation thread inside a step or not: the stop is done, so the
    # process ends here, its log flushed.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main():
    run(checked_main, "server")


if __name__ == "__main__":
    main()
