"""``load_prompt_cache`` says what is wrong with a file before building anything.

Upstream looks any name the file gives up in cache.py's globals (an unknown
class is a bare ``KeyError``, ``"save_prompt_cache"`` an ``AttributeError``),
unpacks a plain weights file's metadata into ``not enough values to
unpack``, passes a corrupted header's ``UnicodeDecodeError`` through, and
loads a file missing a state array into a silently shifted state. Each is
now a ``ValueError`` naming the file and what is wrong with it.
"""

from typing import Any, Dict

import mlx.core as mx
from mlx.utils import tree_unflatten

from ._registry import Patch, Target, pasted_into


def _prompt_cache_from_arrays(
    arrays: Dict[str, Any], cache_metadata: Dict[str, str], source: str
) -> tuple:
    """``(cache, metadata)`` from what ``save_prompt_cache`` wrote."""
    cache_metadata = tree_unflatten(list(cache_metadata.items()))
    if not (isinstance(cache_metadata, list) and len(cache_metadata) == 3):
        raise ValueError(f"{source} is not a prompt cache: it names no cache classes")
    metadata, classes, scalars = cache_metadata
    for c in classes:
        cls = globals().get(c)
        if not (isinstance(cls, type) and issubclass(cls, _BaseCache)):
            raise ValueError(f"{source} names an unknown cache class {c!r}")
    states = {}
    for key in arrays:
        layer, _, index = key.partition(".")
        states.setdefault(int(layer), set()).add(int(index.partition(".")[0]))
    for layer, indices in sorted(states.items()):
        if indices != set(range(len(indices))):
            missing = sorted(set(range(max(indices) + 1)) - indices)
            missing = ", ".join(f"{layer}.{i}" for i in missing)
            raise ValueError(f"{source} lacks state arrays {missing}")
    if sorted(states) != list(range(len(classes))):
        raise ValueError(
            f"{source} has states for {len(states)} caches but names {len(classes)}"
        )
    arrays = dict(arrays)
    for pos, kind in scalars[1:]:
        array = arrays[pos]
        if kind == "scalar":
            arrays[pos] = array.item()
        elif kind == "string":
            arrays[pos] = "".join(chr(i) for i in array.tolist())
        elif kind == "none":
            arrays[pos] = None
        else:
            raise ValueError(f"{source}: unknown scalar type {kind!r}")
    arrays = tree_unflatten(list(arrays.items()))
    cache = [globals()[c].from_state(s) for c, s in zip(classes, arrays)]
    return cache, metadata


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
    try:
        arrays, cache_metadata = mx.load(file_name, return_metadata=True)
    except UnicodeDecodeError as e:
        raise ValueError(f"{file_name} has a corrupted header ({e})") from e
    cache, metadata = _prompt_cache_from_arrays(arrays, cache_metadata, file_name)
    if return_metadata:
        return cache, metadata
    return cache


# Written as they read in mlx_lm/models/cache.py, and run there.
_prompt_cache_from_arrays = pasted_into(
    "mlx_lm.models.cache", _prompt_cache_from_arrays
)
load_prompt_cache = pasted_into("mlx_lm.models.cache", load_prompt_cache)

PATCH = Patch(
    "prompt_cache_files",
    "load_prompt_cache: a ValueError naming the file for every file it cannot load",
    [
        Target(
            "mlx_lm.models.cache",
            "_prompt_cache_from_arrays",
            _prompt_cache_from_arrays,
            None,
        ),
        Target(
            "mlx_lm.models.cache",
            "load_prompt_cache",
            load_prompt_cache,
            "1a64604fd5bd",
        ),
    ],
    uses={
        "mlx_lm.models.cache": (
            "Any",
            "Dict",
            "_BaseCache",
            "mx",
            "tree_unflatten",
        )
    },
)
