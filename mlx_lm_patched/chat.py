"""Drop-in for ``mlx_lm.chat``: same flags and output, patched caches."""

from mlx_lm.chat import main as upstream_main

from mlx_lm_patched._front import run


def main():
    run(upstream_main, "chat")


if __name__ == "__main__":
    main()
