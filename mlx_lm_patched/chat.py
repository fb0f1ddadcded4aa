"""Drop-in for ``mlx_lm.chat``: same flags and output, patched caches."""

from mlx_lm_patched import apply

apply()

from mlx_lm.chat import main  # noqa: E402

if __name__ == "__main__":
    main()
