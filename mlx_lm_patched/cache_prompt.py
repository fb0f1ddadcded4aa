"""Drop-in for ``mlx_lm.cache_prompt``: same flags and output, patched caches."""

from mlx_lm.cache_prompt import main as upstream_main

from mlx_lm_patched._front import run


def main():
    run(upstream_main, "cache_prompt")


if __name__ == "__main__":
    main()
