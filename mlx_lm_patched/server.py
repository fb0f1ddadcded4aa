"""Drop-in for ``mlx_lm.server``: same flags and output, patched caches."""

import argparse
import sys

from mlx_lm.server import main as upstream_main

from mlx_lm_patched import apply


def main():
    apply()
    # The server batches with --kv-bits: a value mx.quantize cannot take would
    # end its generation thread at the first request. Refuse it before serving.
    from mlx_lm.generate import maybe_quantize_kv_cache

    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    parser.add_argument("--kv-bits", type=int)
    parser.add_argument("--kv-group-size", type=int, default=64)
    try:
        args = parser.parse_known_args()[0]
        # With no caches to quantize, only the check runs.
        maybe_quantize_kv_cache([], 0, args.kv_group_size, args.kv_bits)
    except argparse.ArgumentError:
        pass  # not a number: upstream's parser says so
    except ValueError as e:
        sys.exit(f"error: {e}")
    upstream_main()


if __name__ == "__main__":
    main()
