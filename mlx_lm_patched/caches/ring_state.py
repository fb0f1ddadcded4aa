"""What a loaded ``BatchRotatingKVCache`` state must satisfy: its items,
sizes and positions, checked before anything is built from it (a file that
fails is a ``ValueError`` naming what is wrong, not a broken cache).

``batch_rotating_prealloc``'s class takes this method; it runs in
mlx_lm/models/cache.py.
"""

from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    from mlx_lm.models.ring_buffer import _stored


class BatchRotatingKVCache:
    @staticmethod
    def _check_state(v):
        if len(v) not in (8, 9):
            raise ValueError(f"{len(v)} state items, a BatchRotatingKVCache has 8 or 9")
        keys, values, offset, left_padding, max_size, _offset, _idx = v[:7]
        keep = v[8] if len(v) == 9 else 0
        n = _stored(keys, values)
        if max_size < 1 or not 0 <= keep < max_size:
            raise ValueError(
                f"keep {keep} and max_size {max_size}: need 0 <= keep < max_size"
            )
        if not all(isinstance(x, mx.array) and x.ndim == 1 for x in v[2:4]) or (
            offset.size != left_padding.size
        ):
            raise ValueError("offset and left_padding are not one entry per row")
        if _offset < 0:
            raise ValueError(f"_offset {_offset} is negative")
        # The sinks and the live columns once allocated (an empty cache has
        # none); upstream's ring (keep=0) is longer right after a multi-token
        # update, with _idx at the end.
        need = keep + min(_offset, max_size - keep) if n or _offset else 0
        longer = n > max_size and not (keep == 0 and _idx == n)
        if n < need or longer:
            raise ValueError(
                f"{n} slots stored for _offset {_offset}, keep {keep}, max_size {max_size}"
            )
        wrapped = _offset > max_size - keep
        if not (keep <= _idx <= n if wrapped else _idx == keep + _offset):
            raise ValueError(
                f"_idx {_idx} does not fit _offset {_offset} and keep {keep}"
            )
