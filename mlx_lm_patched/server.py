"""Drop-in for ``mlx_lm.server``: same flags and output, patched caches."""

from mlx_lm.server import main as upstream_main

from mlx_lm_patched import apply


def main():
    apply()
    upstream_main()


if __name__ == "__main__":
    main()
