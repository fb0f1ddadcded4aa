"""Drop-in for ``mlx_lm.generate``: same flags and output, patched caches."""

from mlx_lm_patched import apply

apply()

from mlx_lm.generate import main  # noqa: E402

if __name__ == "__main__":
    main()
