"""A directory of prompt-cache files that servers can share: the new module
``mlx_lm/models/prompt_cache_dir.py`` (its reading in ``prompt_cache_read.py``).

``PromptCacheDir(directory, max_bytes)`` is what the disk tier
(``prompt_cache_disk``) stands on: entry files named by a hash of their
model key and tokens, found by a scan that opens only regular entry files,
without following links, reading each header within a bound (a FIFO once
blocked a server's start, a 3 GiB sparse file was read whole). An entry is
indexed only if its header's manifest digest (``_manifest``: every field
but the checksums) matches; anything else is skipped with a warning naming
it. The budget is counted (``_shrink``, ``prompt_cache_disk_blocks``: with
the block files entries share) over every file under an ``flock`` of the
directory, so replicas sharing it hold it together (two held 7.77 MB of a
4 MB budget when each counted its own), oldest mtime first; a killed
writer's temporary files go at the next count; on a full disk the oldest
entries make room; replicas find each other's new files (``_refresh``). A
file where an entry or block goes that is not a regular file this process
can open (a link, a directory, ``EACCES``) is a miss and is set aside
(``_set_aside``), so the next write puts the file there. A
model key names the weights (a digest of each local directory's files,
``_model_key``) and ``scope`` (a server's ``--kv-bits``). An entry's data
is read by several threads (``_read_arrays``), each checking what it read
(CRC-32, finite floats); how fast restores went is kept (``read_rate``).
"""

from .._newmods import new_module
from .._registry import Patch

PATCH = Patch(
    "prompt_cache_dir",
    "PromptCacheDir: prompt-cache files in a directory servers share, verified "
    "by a manifest, scanned without blocking, within one budget",
    new_module("mlx_lm.models.prompt_cache_read")
    + new_module("mlx_lm.models.prompt_cache_dir"),
)
