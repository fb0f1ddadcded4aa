"""python -m mlx_lm_patched.bench COMMAND [options]

Each command runs the module of its name (``python -m
mlx_lm_patched.bench.<command>`` does the same); ``all`` runs ``memory``
with the options given, then ``quantized`` with its defaults.
"""

import functools
import importlib
import sys

MODULES = [
    "memory",
    "quantized",
    "soak",
    "prompt_cache",
    "e2e",
    "attention",
    "disk",
    "disk_write",
    "slack",
    "rounds",
    "quality",
    "qdecode",
    "checkpoints",
    "prefix_blocks",
    "serve",
]


def run(name, argv):
    return importlib.import_module(f"{__package__}.{name}").main(argv)


def run_all(argv):
    run("memory", argv)
    run("quantized", [])


COMMANDS = {
    **{name: functools.partial(run, name) for name in MODULES},
    "all": run_all,
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        print(f"COMMAND: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    COMMANDS[argv[0]](argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
