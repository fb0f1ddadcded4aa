"""python -m mlx_lm_patched.bench {memory,quantized,soak,prompt_cache,all} [options]

``all`` runs ``memory`` with the options given, then ``quantized`` with its
defaults.
"""

import sys


def quantized(argv):
    try:
        from . import quantized
    except ModuleNotFoundError as e:
        if e.name != __package__ + ".quantized":
            raise
        print("[bench] quantized: not available yet, skipped", file=sys.stderr)
        return None
    return quantized.main(argv)


def memory(argv):
    from . import memory

    return memory.main(argv)


def soak(argv):
    from . import soak

    return soak.main(argv)


def prompt_cache(argv):
    from . import prompt_cache

    return prompt_cache.main(argv)


def run_all(argv):
    memory(argv)
    quantized([])


COMMANDS = {
    "memory": memory,
    "quantized": quantized,
    "soak": soak,
    "prompt_cache": prompt_cache,
    "all": run_all,
}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    COMMANDS[argv[0]](argv[1:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
