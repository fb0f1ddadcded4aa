"""Prompt caches copied to host memory, written to a ``.safetensors`` file
that ``load_prompt_cache`` reads from any thread, bit for bit."""

import copy
import json
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import mlx.core as mx

from .cache import _prompt_cache_from_arrays


@dataclass
class HostPromptCache:
    """A prompt cache copied to host memory, for serializing on any thread.

    ``arrays`` are numpy copies of the state arrays, bfloat16 as its uint16
    bits; ``dtypes`` names each array's MLX dtype; ``metadata`` is what
    ``save_prompt_cache`` writes. ``save`` uses no MLX.
    """

    arrays: Dict[str, Any]
    dtypes: Dict[str, str]
    metadata: Dict[str, str]

    @property
    def nbytes(self):
        return sum(a.nbytes for a in self.arrays.values())

    def header(self):
        """The ``.safetensors`` header ``save`` writes: each array's dtype,
        shape and data offsets, in the order written, and the metadata."""
        codes = {
            "bool": "BOOL", "uint8": "U8", "uint16": "U16", "uint32": "U32",
            "uint64": "U64", "int8": "I8", "int16": "I16", "int32": "I32",
            "int64": "I64", "float16": "F16", "bfloat16": "BF16",
            "float32": "F32", "float64": "F64",
        }  # fmt: skip
        header = {"__metadata__": self.metadata}
        start = 0
        for k, a in self.arrays.items():
            dtype = codes[self.dtypes[k]]
            header[k] = {"dtype": dtype, "shape": list(a.shape)}
            header[k]["data_offsets"] = [start, start + a.nbytes]
            start += a.nbytes
        return header

    def save(self, file_name: str):
        """Write a ``.safetensors`` file that ``load_prompt_cache`` reads."""
        header = json.dumps(self.header()).encode()
        header += b" " * (-len(header) % 8)
        with open(file_name, "wb") as f:
            f.write(len(header).to_bytes(8, "little"))
            f.write(header)
            for a in self.arrays.values():
                f.write(a.astype(a.dtype.newbyteorder("<"), order="C", copy=False).data)


def _flatten(tree, prefix: str = "", out=None):
    """``tree_flatten(tree)``, without its generality: a prompt cache with
    checkpoints holds thousands of arrays, flattened at every disk write (a
    2,688-array cache's state took 13.0 ms with ``tree_flatten`` on this
    CPU, 11.0 with this)."""
    out = [] if out is None else out
    if isinstance(tree, (list, tuple)):
        for i, x in enumerate(tree):
            _flatten(x, f"{prefix}.{i}" if prefix else str(i), out)
    elif isinstance(tree, dict):
        for k, x in tree.items():
            _flatten(x, f"{prefix}.{k}" if prefix else str(k), out)
    else:
        out.append((prefix, tree))
    return out


def _checkpoints(cache: List[Any]):
    """``(layer index, checkpoint)`` of each of ``cache``'s rings' checkpoints,
    which ``prompt_cache_state`` keeps after the layers."""
    return [(i, c) for i, x in enumerate(cache) for c in getattr(x, "checkpoints", ())]


def _state_nbytes(cache: List[Any]) -> int:
    """The bytes of the arrays ``prompt_cache_state(cache)`` holds, but for the
    few it makes of scalars: counted without making its state (a view and a
    schedule an array)."""
    layers = [*cache, *(c for _, c in _checkpoints(cache))]
    flat = _flatten([c.state for c in layers])
    return sum(x.nbytes for _, x in flat if isinstance(x, mx.array))


def prompt_cache_state(
    cache: List[Any], metadata: Optional[Dict[str, str]] = None
) -> HostPromptCache:
    """``cache``'s state scheduled on the calling thread, not copied nor
    waited for: a ``HostPromptCache`` of MLX arrays (bfloat16 viewed as
    uint16) that any thread may copy to host, waiting for them (another
    thread cannot schedule them: "There is no Stream(cpu, 0) in current
    thread"). Holding them keeps their buffers from being donated to an
    update, so they do not change. Rings' checkpoints
    (``RotatingKVCache._checkpoint``) follow the layers as caches of their
    own, the metadata's ``ring_checkpoints`` naming each one's layer and
    position (``_prompt_cache_from_arrays`` puts them back)."""
    held = _checkpoints(cache)
    if held:
        positions = json.dumps([[i, c.offset] for i, c in held])
        metadata = {**(metadata or {}), "ring_checkpoints": positions}
        cache = [*cache, *(c for _, c in held)]
    scalars = [""]  # as in save_prompt_cache
    arrays, dtypes, made = {}, {}, {}  # made: one array a scalar value
    names = {}  # dtype -> its name
    for k, data in _flatten([c.state for c in cache]):
        if isinstance(data, mx.array):
            # Its own handle on the buffer: ``c.keys[...] = x`` replaces what
            # the cache's handle points to (measured: a held handle then reads
            # the update, unevaluated), never the buffer a handle holds.
            data = copy.copy(data)
        elif isinstance(data, (int, float, bool)):
            scalars.append((k, "scalar"))
            key = (type(data), data)
            data = made[key] = made[key] if key in made else mx.array(data)
        elif isinstance(data, str):
            scalars.append((k, "string"))
            data = mx.array([ord(char) for char in data])
        elif data is None:
            scalars.append((k, "none"))
            data = mx.array([])
        else:
            raise ValueError(f"Model state is not serializable: {data}")
        dtype = data.dtype
        if dtype not in names:
            names[dtype] = str(dtype).rpartition(".")[2]
        dtypes[k] = names[dtype]
        arrays[k] = data.view(mx.uint16) if dtype == mx.bfloat16 else data
    mx.async_eval(list(arrays.values()))
    classes = [type(c).__name__ for c in cache]
    cache_metadata = dict(_flatten([metadata or {}, classes, scalars]))
    return HostPromptCache(arrays, dtypes, cache_metadata)


def prompt_cache_to_host(
    cache: List[Any], metadata: Optional[Dict[str, str]] = None
) -> HostPromptCache:
    """Evaluate ``cache`` and copy its state to numpy, on the calling thread."""
    import numpy as np

    state = prompt_cache_state(cache, metadata)
    arrays = {k: np.array(a) for k, a in state.arrays.items()}
    return HostPromptCache(arrays, state.dtypes, state.metadata)


def prompt_cache_from_host(host: HostPromptCache, return_metadata=False):
    """The prompt cache ``prompt_cache_to_host`` copied, bit for bit."""
    arrays = {
        k: mx.array(a).view(getattr(mx, host.dtypes[k])) for k, a in host.arrays.items()
    }
    cache, metadata = _prompt_cache_from_arrays(arrays, host.metadata, "host snapshot")
    if return_metadata:
        return cache, metadata
    return cache
