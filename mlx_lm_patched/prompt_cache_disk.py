"""A disk tier for prompt caches: entries found again after a restart.

mlx-lm's prompt cache lives in RAM: what ``LRUPromptCache`` evicts is gone,
and a restarted server starts cold (ml-explore/mlx-lm#1178). Servers built
on mlx-lm keep an SSD tier (vllm-mlx, omlx), and their spills break on the
caches mlx-lm makes: numpy has no bfloat16 ("Item size 2 for PEP 3118 buffer
format string B"), a quantized cache's keys are tuples; their fixes
dequantize and cast to float16 before writing, which changes the tokens.

``DiskPromptCache(directory, max_bytes)`` keeps prompt caches as files
``load_prompt_cache`` reads. ``put`` takes the host snapshot
(``prompt_cache_to_host``: bfloat16 as its bits, quantized caches as their
packed triples, nothing upcast) on the calling thread, and a background
thread writes it (a temporary file renamed into place), named by a hash of
the model key and tokens, which the file's metadata holds with a CRC-32 of
its data. ``get`` returns the longest stored prefix of a prompt (or a
longer entry trimmed to it, as ``LRUPromptCache.fetch_nearest_cache``
does) as a working cache, bit for bit, and the tokens left to prefill. The
directory holds at most ``max_bytes`` of entries (the least recently used
go first) and is scanned on construction, so entries survive a restart. A
corrupt, truncated or foreign file is skipped with a warning naming it,
never served and never raised: the name must be the hash of what the
header says, the size what the header needs, and the data its CRC.

``DiskLRUPromptCache(disk, max_size, max_bytes)`` is an ``LRUPromptCache``
that writes every entry it evicts (``_evict``, ``prompt_cache_store``) to
``disk`` and, where memory holds less of a prompt than the disk tier,
serves it from there.
"""

import hashlib
import json
import logging
import os
import queue
import threading
import zlib
from typing import Any, List

from mlx_lm.models.cache import LRUPromptCache

from ._registry import Patch, Target, cache_class


class DiskPromptCache:
    """Prompt caches in ``directory``, at most ``max_bytes`` of files.

    Each file is a ``.safetensors`` prompt cache named by a hash of its model
    key and tokens; its metadata holds both (model keys compare by ``repr``).
    ``put`` returns once its host copy is taken (host memory holds at most
    six queued copies): ``flush`` waits for the writes, ``close`` ends the
    writer.
    """

    def __init__(self, directory: str, max_bytes: int = 1 << 63):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._trie = PromptTrie()
        # name -> (model, tokens, tokens it can trim, file bytes), least recently used first
        self._files = {}
        self._n_bytes = 0
        found = []
        for name in os.listdir(directory):
            path = os.path.join(directory, name)
            try:
                found.append((os.path.getmtime(path), name, self._read_header(path)))
            except Exception as e:
                logging.warning(f"[prompt cache] skipping {path}: {e!r}")
        for _, name, entry in sorted(found):
            self._add(name, entry)
        self._shrink()
        self._queue = queue.Queue(maxsize=4)
        self._writer = threading.Thread(target=self._write_loop, daemon=True)
        self._writer.start()

    def __len__(self):
        return len(self._files)

    @property
    def nbytes(self):
        return self._n_bytes

    @staticmethod
    def _name(model: str, tokens: List[int]):
        key = json.dumps([model, tokens]).encode()
        return hashlib.sha256(key).hexdigest()[:32] + ".safetensors"

    def _read_header(self, path: str):
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            if not 0 < n <= size - 8:
                raise ValueError("not a safetensors file")
            header = json.loads(f.read(n))
        # What prompt_cache_to_host made of put's metadata.
        meta = header.pop("__metadata__")
        model, tokens = meta["0.model"], json.loads(meta["0.tokens"])
        if os.path.basename(path) != self._name(model, tokens):
            raise ValueError("its name is not the hash of its model and tokens")
        end = max((v["data_offsets"][1] for v in header.values()), default=0)
        if size != 8 + n + end:
            raise ValueError(f"{size} bytes where its header needs {8 + n + end}")
        return model, tokens, int(meta["0.trimmable"]), size

    def _add(self, name: str, entry: tuple):
        self._files[name] = entry
        self._trie.add(entry[0], entry[1], name)
        self._n_bytes += entry[3]

    def _drop(self, name: str):
        model, tokens, _, n_bytes = self._files.pop(name)
        self._trie.pop(model, tokens)
        self._n_bytes -= n_bytes

    def _shrink(self):
        while self._n_bytes > self.max_bytes:
            name = next(iter(self._files))
            self._drop(name)
            try:
                os.remove(os.path.join(self.directory, name))
            except OSError as e:
                logging.warning(f"[prompt cache] could not remove {name}: {e!r}")

    def put(self, model: Any, tokens: List[int], cache: List[Any]):
        """Queue ``cache``, the cache of ``tokens``, to be written. Its host
        copy is taken here; queueing it waits while four others are queued."""
        if not self._writer.is_alive():
            raise ValueError("DiskPromptCache.put after close()")
        tokens = [int(t) for t in tokens]
        # The most tokens trim_prompt_cache can take off exactly (a wrapped
        # ring: its slack); can_trim_prompt_cache is monotone in the count.
        trimmable, hi = 0, len(tokens)
        while trimmable < hi:
            mid = (trimmable + hi + 1) // 2
            trimmable, hi = (
                (mid, hi) if can_trim_prompt_cache(cache, mid) else (trimmable, mid - 1)
            )
        metadata = {
            "model": repr(model),
            "tokens": json.dumps(tokens),
            "trimmable": str(trimmable),
        }
        host = prompt_cache_to_host(cache, metadata)
        entry = (repr(model), tokens, trimmable)
        self._queue.put((self._name(repr(model), tokens), entry, host))

    def _write_loop(self):
        while (item := self._queue.get()) is not None:
            try:
                self._write(*item)
            except Exception as e:
                logging.warning(f"[prompt cache] could not write {item[0]}: {e!r}")
            finally:
                self._queue.task_done()
        self._queue.task_done()

    def _write(self, name: str, entry: tuple, host):
        if host.nbytes > self.max_bytes:
            return
        crc = 0
        for k in sorted(host.arrays):
            a = host.arrays[k]
            crc = zlib.crc32(a.astype(a.dtype.newbyteorder("<"), copy=False), crc)
        host.metadata["0.crc32"] = str(crc)  # next to put's metadata
        path = os.path.join(self.directory, name)
        temp = f"{path}.{os.getpid()}.tmp"
        try:
            host.save(temp)
            os.replace(temp, path)
        finally:
            if os.path.exists(temp):
                os.remove(temp)
        with self._lock:
            if name in self._files:
                self._drop(name)
            self._add(name, (*entry, os.path.getsize(path)))
            self._shrink()

    def _load(self, name: str):
        """The cache in file ``name``, or ``None`` (warned) if it is not sound."""
        path = os.path.join(self.directory, name)
        try:
            import numpy as np

            arrays, metadata = mx.load(path, return_metadata=True)
            mx.eval(list(arrays.values()))
            crc = 0
            for k in sorted(arrays):  # as bits, as _write saw them
                bits = getattr(mx, f"uint{8 * arrays[k].dtype.size}")
                crc = zlib.crc32(np.asarray(arrays[k].view(bits)), crc)
            if crc != int(metadata["0.crc32"]):
                raise ValueError("its data does not match its CRC-32")
            return _prompt_cache_from_arrays(arrays, metadata, path)[0]
        except Exception as e:
            logging.warning(f"[prompt cache] skipping {path}: {e!r}")
            return None

    def get(self, model: Any, tokens: List[int], cached: int = 0):
        """``(cache, tokens left to prefill)`` from the entry that reuses the
        most of ``tokens`` for ``model``, if it reuses more than ``cached``;
        else ``None``."""
        model = repr(model)
        while True:
            with self._lock:
                result = self._trie.search(model, tokens)
                if result.exact is not None:
                    stored, n = result.exact, len(tokens)
                else:
                    stored, longer = result.shorter, result.longer
                    n = len(stored) if stored is not None else 0
                    # A longer entry trimmed back, where it can be trimmed.
                    prefix = min(len(tokens) - 1, result.common_prefix)
                    if longer is not None and prefix > n:
                        if (
                            self._files[self._name(model, longer)][2]
                            >= len(longer) - prefix
                        ):
                            stored, n = longer, prefix
                if n <= cached:
                    return None
                name = self._name(model, stored)
            cache = self._load(name)
            with self._lock:
                if name not in self._files:
                    continue
                if cache is None:
                    self._drop(name)
                    continue
                self._files[name] = self._files.pop(name)  # most recently used
            try:
                os.utime(os.path.join(self.directory, name))
            except OSError:
                pass
            if len(stored) > n:
                trim_prompt_cache(cache, len(stored) - n)
            return cache, tokens[n:]

    def flush(self):
        """Wait until every queued cache is written."""
        self._queue.join()

    def close(self):
        """Write what is queued and end the writer thread."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()


class DiskLRUPromptCache(LRUPromptCache):
    """An ``LRUPromptCache`` that writes what it evicts to ``disk`` (a
    ``DiskPromptCache``) and reads from it where memory has less."""

    def __init__(
        self, disk: DiskPromptCache, max_size: int = 10, max_bytes: int = 1 << 63
    ):
        LRUPromptCache.__init__(self, max_size, max_bytes)
        self.disk = disk

    def fetch_nearest_cache(self, model: Any, tokens: List[int]):
        cache, rest = LRUPromptCache.fetch_nearest_cache(self, model, tokens)
        if rest:
            found = self.disk.get(model, tokens, cached=len(tokens) - len(rest))
            if found is not None:
                return found
        return cache, rest

    def _evict(self):
        model, tokens, entry = LRUPromptCache._evict(self)
        self.disk.put(model, tokens, entry.prompt_cache)
        return model, tokens, entry


# Written as they read in mlx_lm/models/cache.py, and run there.
DiskPromptCache = cache_class("mlx_lm.models.cache", DiskPromptCache)
DiskLRUPromptCache = cache_class(
    "mlx_lm.models.cache", DiskLRUPromptCache, LRUPromptCache
)

PATCH = Patch(
    "prompt_cache_disk",
    "DiskPromptCache: prompt caches on disk, written by a background thread, "
    "bit-exact, bounded, found again after a restart",
    [
        Target("mlx_lm.models.cache", m.__name__, m, None)
        for m in (hashlib, json, logging, os, queue, threading, zlib)
    ]
    + [
        Target("mlx_lm.models.cache", "DiskPromptCache", DiskPromptCache, None),
        Target("mlx_lm.models.cache", "DiskLRUPromptCache", DiskLRUPromptCache, None),
    ],
    requires=("mlx_lm.models.cache:LRUPromptCache._evict",),
)
