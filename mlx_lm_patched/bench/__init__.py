"""Benchmarks: ``python -m mlx_lm_patched.bench <command>`` (see ``__main__``).

What the benchmarks share: parsing with ``--device``, the keys their JSON
starts with, and printing (and with ``--out``, writing) that JSON.
"""

import json
from importlib.metadata import version

import mlx.core as mx


def parse_args(parser, argv):
    """Parse ``argv``; a ``--device`` given becomes MLX's default device."""
    args = parser.parse_args(argv)
    if args.device:
        mx.set_default_device(getattr(mx, args.device))
    return args


def header(benchmark, patches):
    """The keys every benchmark's JSON starts with, in this order."""
    return {
        "benchmark": benchmark,
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "patches": patches,
    }


def emit(result, path=None, indent=1):
    """Print ``result`` as JSON; with ``path``, also write it there."""
    text = json.dumps(result, indent=indent)
    print(text)
    if path:
        with open(path, "w") as f:
            f.write(text + "\n")
