"""``load_prompt_cache`` says what is wrong with a file before building anything
(the checks: the new module ``mlx_lm/models/prompt_cache_checks.py``).

Upstream looks any name the file gives up in cache.py's globals (an unknown
class is a bare ``KeyError``, ``"save_prompt_cache"`` an ``AttributeError``),
unpacks a plain weights file's metadata into ``not enough values to
unpack``, passes a corrupted header's ``UnicodeDecodeError`` through, and
loads a file missing a state array into a silently shifted state. Each is
now a ``ValueError`` naming the file and what is wrong with it.

Each cache's state is also checked against itself before anything is built
(``_check_state``, next to each class's ``state``): upstream loads an offset
past the stored tokens, ``keep > max_size`` or keys cut short and decodes
garbage, fails on a negative offset or ``max_size`` 0 with
``ZeroDivisionError``, on a state under another class's name with ``too many
values to unpack``, and on changed bits with a broadcast error at decode.
Now: ``ValueError`` naming the file, the layer and the inconsistency.

The rest of a file is checked too: metadata that does not unflatten, a
string where the list of scalars goes, a scalar that is not one integer
(an offset stored as a float loaded silently), keys or values that are not
floats (integers loaded silently) or hold NaN or infinities, an array that
is no state entry: each a ``ValueError`` naming the file, where upstream
raised ``KeyError``, ``TypeError``, an error naming no file, or nothing.
``prompt_cache_mismatch`` says why a cache cannot serve a model (another
layer count or head layout; ``prompt_cache_layout``), for ``generate
--prompt-cache-file`` and the server's disk tier. Rings' window checkpoints
stored after the layers (``rotating_prealloc``, ``prompt_cache_state``) go
back on their rings, each checked against its ring (``_with_checkpoints``).
A path that is not a regular file (a FIFO: upstream's ``mx.load`` blocks
for good) is refused before it is opened.
"""

from typing import TYPE_CHECKING

import mlx.core as mx

from .._newmods import hooks, new_module
from .._registry import Patch, pasted_into, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    from mlx_lm.models.prompt_cache_checks import _prompt_cache_from_arrays
    from mlx_lm.models.ring_buffer import _stored


def load_prompt_cache(file_name, return_metadata=False):
    """
    Load a prompt cache from a file.

    Args:
        file_name (str): The ``.safetensors`` file name.
        return_metadata (bool): Whether or not to return metadata.
            Default: ``False``.

    Returns:
        List[Any] or Tuple[List[Any], Dict[str, str]]: The prompt cache and
            the metadata if requested.
    """
    # A FIFO or a device would block the read or never end it: not opened.
    import os  # here: quantized_cache, a later patch, puts os in this module
    import stat

    try:
        mode = os.stat(file_name).st_mode
    except (OSError, TypeError, ValueError):
        mode = None  # mx.load says what is wrong
    if mode is not None and not stat.S_ISREG(mode):
        raise ValueError(f"{file_name} is not a regular file")
    try:
        arrays, cache_metadata = mx.load(file_name, return_metadata=True)
    except UnicodeDecodeError as e:
        raise ValueError(f"{file_name} has a corrupted header ({e})") from e
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{file_name} cannot be read as a prompt cache: {e}") from e
    cache, metadata = _prompt_cache_from_arrays(arrays, cache_metadata, file_name)
    if return_metadata:
        return cache, metadata
    return cache


class KVCache:
    @staticmethod
    def _check_state(v):
        if len(v) != 3:
            raise ValueError(f"{len(v)} state items, a KVCache has 3")
        keys, values, offset = v
        n = _stored(keys, values)
        if not 0 <= offset <= n:
            raise ValueError(f"offset {offset} is not within the {n} tokens stored")


class BatchKVCache:
    @staticmethod
    def _check_state(v):
        if len(v) != 5:
            raise ValueError(f"{len(v)} state items, a BatchKVCache has 5")
        keys, values, offset, left_padding, _idx = v
        n = _stored(keys, values)
        if not all(isinstance(x, mx.array) and x.ndim == 1 for x in v[2:4]) or (
            offset.size != left_padding.size
        ):
            raise ValueError("offset and left_padding are not one entry per row")
        if not 0 <= _idx <= n:
            raise ValueError(f"_idx {_idx} is not within the {n} tokens stored")
        # Row b is padding up to left_padding[b], then offset[b] real tokens.
        if not mx.array_equal(offset + left_padding, mx.full(offset.shape, _idx)):
            raise ValueError(
                f"offset {offset.tolist()} + left_padding {left_padding.tolist()} "
                f"is not _idx {_idx} in every row"
            )


# Written as it reads in mlx_lm/models/cache.py, and run there.
load_prompt_cache = pasted_into("mlx_lm.models.cache", load_prompt_cache)

PATCH = Patch(
    "prompt_cache_files",
    "load_prompt_cache: a ValueError naming the file for every file it cannot "
    "load; prompt_cache_mismatch: a cache of another layout is refused",
    new_module("mlx_lm.models.prompt_cache_checks")
    + hooks(
        "mlx_lm.models.cache",
        "mlx_lm.models.prompt_cache_checks",
        "_prompt_cache_from_arrays",
        "prompt_cache_layout",
        "prompt_cache_mismatch",
    )
    + hooks("mlx_lm.models.cache", "mlx_lm.models.ring_buffer", "_stored")
    + targets("mlx_lm.models.cache", load_prompt_cache)
    + targets("mlx_lm.models.cache:KVCache", KVCache)
    + targets("mlx_lm.models.cache:BatchKVCache", BatchKVCache),
    requires=(
        "mlx_lm.models.cache:RotatingKVCache._check_state",
        "mlx_lm.models:ring_buffer",
    ),
)
