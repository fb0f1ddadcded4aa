"""Drop-in for ``mlx_lm.server``: same flags and output, patched caches."""

import argparse

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
    upstream_main()


def main():
    run(checked_main)


if __name__ == "__main__":
    main()
