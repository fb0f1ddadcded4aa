"""What every drop-in CLI front does around mlx-lm's own ``main``."""

import argparse
import os
import sys
import warnings

from mlx_lm_patched import PatchDriftWarning, apply

# Upstream's default --quantized-kv-start (mlx_lm.generate).
QUANTIZED_KV_START = 5000

# What each front is, for its --help (the server's: server_prompt_cache.main).
DESCRIPTIONS = {
    "generate": "Generate text with an MLX model: mlx-lm's generate with "
    "mlx-lm-patched's KV caches.",
    "chat": "Chat with an MLX model in the terminal: mlx-lm's chat with "
    "mlx-lm-patched's KV caches.",
    "cache_prompt": "Cache the state of a prompt in a file, to be reused with "
    "mlx_lm_patched.generate --prompt-cache-file: mlx-lm's cache_prompt with "
    "mlx-lm-patched's KV caches.",
    "benchmark": "Measure prompt and generation speed of an MLX model: "
    "mlx-lm's benchmark with mlx-lm-patched's KV caches.",
}
# What a flag does here, where upstream's help says otherwise or less.
HELP = {
    "--max-kv-size": "Tokens of cache a layer keeps: full-attention layers "
    "become rings of this many tokens that keep the first 4 "
    "(RotatingKVCache(N, keep=4)), sliding-window layers a window no larger; "
    "every model (default: none, unbounded)",
    "--kv-bits": "Bits of the quantized KV cache: 2, 3, 4, 5, 6 or 8, from "
    "--quantized-kv-start on; every cache, rings included; a value it cannot "
    "take is an error before the first token (default: none, full precision)",
    "--kv-group-size": "Group size of --kv-bits: 32, 64 or 128 (default: 64)",
    "--quantized-kv-start": "With --kv-bits, quantize a cache once it holds "
    "this many tokens; 0 quantizes from the first token "
    f"(default: {QUANTIZED_KV_START})",
    "--prompt-cache-file": "A prompt cache file made by "
    "mlx_lm_patched.cache_prompt: its prompt is not computed again, --prompt "
    "continues it; a file it cannot use is a one-line error",
    "--draft-model": "A model to be used for speculative decoding; works "
    "with --max-kv-size and sliding-window models, same tokens as without it",
}
# Where one front's flag does something else.
FRONT_HELP = {
    "cache_prompt": {
        "--prompt-cache-file": "The file to save the prompt cache in, for "
        "mlx_lm_patched.generate --prompt-cache-file",
    },
}


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


def described(setup_arg_parser, name):
    """``setup_arg_parser`` (upstream's), its parser's help saying what this
    front is and does (``DESCRIPTIONS``, ``HELP``) and every default."""

    def ours():
        parser = setup_arg_parser()
        parser.description = DESCRIPTIONS.get(name, parser.description)
        helps = {**HELP, **FRONT_HELP.get(name, {})}
        for action in parser._actions:
            for flag in action.option_strings:
                action.help = helps.get(flag, action.help)
            default = action.default  # none, off or empty: not shown
            if default is None or default is False or default is argparse.SUPPRESS:
                continue
            if isinstance(default, (str, list, tuple)) and not default:
                continue
            if action.help and "default" not in action.help.lower():
                action.help += " (default: %(default)s)"
        return parser

    return ours


def one_line(show):
    """``warnings.showwarning`` that shows this package's warnings in one line,
    without the source line Python adds (a command's user did not write it),
    and every other warning with ``show``."""

    def shown(message, category, filename, lineno, file=None, line=None):
        text = str(message)
        if issubclass(category, PatchDriftWarning) or text.startswith(
            "mlx_lm_patched:"
        ):
            print(f"{category.__name__}: {text}", file=file or sys.stderr)
        else:
            show(message, category, filename, lineno, file, line)

    return shown


def run(upstream_main, name):
    """Apply the patches, then run ``upstream_main`` as ``mlx_lm_patched.<name>``
    (the program name its help and errors print; its help ``described``); bad
    input (a missing file, a ``ValueError``: a flag, a cache file) ends in one
    line on stderr and exit status 1, not a traceback; this package's
    warnings are one line each (``one_line``)."""
    prog = sys.argv[0] = f"mlx_lm_patched.{name}"
    preflight(prog, sys.argv[1:])
    apply()
    module = sys.modules[upstream_main.__module__]
    setup = getattr(module, "setup_arg_parser", None)
    if setup is not None:  # the server's parser is server_prompt_cache's
        module.setup_arg_parser = described(setup, name)
    try:
        with warnings.catch_warnings():  # puts showwarning back
            warnings.showwarning = one_line(warnings.showwarning)
            upstream_main()
    except ValueError as e:
        sys.exit(f"{prog}: error: {e}")
    except RuntimeError as e:
        if not str(e).startswith("[load"):
            raise
        sys.exit(f"{prog}: error: {e}")  # MLX could not read a file
    finally:
        if setup is not None:
            module.setup_arg_parser = setup
