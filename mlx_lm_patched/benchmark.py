"""Drop-in for ``mlx_lm.benchmark``: same flags and output, patched caches."""

from mlx_lm.benchmark import main as upstream_main

from mlx_lm_patched._front import run


def main():
    run(upstream_main, "benchmark")


if __name__ == "__main__":
    main()
