"""Drop-in for ``mlx_lm.generate``: same flags and output, patched caches."""

import sys
import types

from mlx_lm.generate import generate
from mlx_lm.generate import main as upstream_main

from mlx_lm_patched._front import run


def main():
    run(upstream_main, "generate")


class _CallableModule(types.ModuleType):
    """Importing this module sets ``mlx_lm_patched.generate`` to it; calling
    it still runs mlx-lm's ``generate`` function."""

    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    main()
