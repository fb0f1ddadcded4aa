"""What every drop-in CLI front does around mlx-lm's own ``main``."""

import sys

from mlx_lm_patched import apply


def run(upstream_main):
    """Apply the patches, then run ``upstream_main``; bad input (a
    ``ValueError``: a flag, a cache file) ends in one line on stderr and exit
    status 1, not a traceback."""
    apply()
    try:
        upstream_main()
    except ValueError as e:
        sys.exit(f"error: {e}")
