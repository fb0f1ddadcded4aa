"""What every drop-in CLI front does around mlx-lm's own ``main``."""

import argparse
import os
import sys

from mlx_lm_patched import apply

# Upstream's default --quantized-kv-start (mlx_lm.generate).
QUANTIZED_KV_START = 5000


def preflight(prog, argv):
    """Checks upstream makes late or not at all: a missing file ends in one
    line; ``--kv-bits`` without ``--quantized-kv-start`` gets one notice."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--model")
    parser.add_argument("--prompt-cache-file")
    parser.add_argument("--kv-bits")
    parser.add_argument("--quantized-kv-start")
    try:
        args = parser.parse_known_args(argv)[0]
    except SystemExit:
        return  # upstream's parser says what is wrong
    model = args.model or ""
    if model.startswith(("/", "./", "../", "~")) and not os.path.isdir(
        os.path.expanduser(model)
    ):
        sys.exit(f"{prog}: error: --model {model}: no such directory")
    path = args.prompt_cache_file
    if prog.endswith(".generate") and path is not None:
        if not os.path.isfile(path):
            sys.exit(f"{prog}: error: --prompt-cache-file {path}: no such file")
        if not os.access(path, os.R_OK):
            sys.exit(f"{prog}: error: --prompt-cache-file {path}: not readable")
    # An unsupported --kv-bits gets its error, not this notice.
    if (
        args.kv_bits in {"2", "3", "4", "5", "6", "8"}
        and args.quantized_kv_start is None
    ):
        print(
            f"{prog}: note: --kv-bits quantizes a cache once it holds "
            f"{QUANTIZED_KV_START} tokens (--quantized-kv-start); shorter "
            "ones stay in full precision. --quantized-kv-start 0 quantizes "
            "from the first token.",
            file=sys.stderr,
        )


def run(upstream_main, name):
    """Apply the patches, then run ``upstream_main`` as ``mlx_lm_patched.<name>``
    (the program name its help and errors print); bad input (a missing file,
    a ``ValueError``: a flag, a cache file) ends in one line on stderr and exit
    status 1, not a traceback."""
    prog = sys.argv[0] = f"mlx_lm_patched.{name}"
    preflight(prog, sys.argv[1:])
    apply()
    try:
        upstream_main()
    except ValueError as e:
        sys.exit(f"{prog}: error: {e}")
    except RuntimeError as e:
        if not str(e).startswith("[load"):
            raise
        sys.exit(f"{prog}: error: {e}")  # MLX could not read a file
