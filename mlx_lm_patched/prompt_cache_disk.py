"""A disk tier for prompt caches: entries found again after a restart.

mlx-lm's prompt cache lives in RAM: what ``LRUPromptCache`` evicts is gone,
and a restarted server starts cold (ml-explore/mlx-lm#1178). Servers built
on mlx-lm keep an SSD tier (vllm-mlx, omlx), and their spills break on the
caches mlx-lm makes: numpy has no bfloat16 ("Item size 2 for PEP 3118 buffer
format string B"), a quantized cache's keys are tuples; their fixes
dequantize and cast to float16 before writing, which changes the tokens.

``DiskPromptCache(directory, max_bytes)`` keeps prompt caches as files
``load_prompt_cache`` reads, in a ``PromptCacheDir`` (``prompt_cache_dir``:
the names, the manifest, the scan, the shared budget). ``put`` takes the
host snapshot (``prompt_cache_to_host``: bfloat16 as its bits, quantized
caches as their packed triples, nothing upcast) on the calling thread, and
a background thread writes it (a locked temporary file renamed into place).
``get`` returns the longest stored prefix of a prompt (or a longer entry
trimmed to it, as ``LRUPromptCache.fetch_nearest_cache`` does) as a working
cache, bit for bit, and the tokens left to prefill.

An entry is served only if everything that shapes it is verified: its
manifest digest covers every header field (dtypes, shapes, offsets, tokens,
trim count, cache classes), its CRC-32 its data, its name the hash of its
model and tokens, each layer holds the tokens the header names, and its
layout is the model's own caches' (``prompt_cache_mismatch``). Anything
else is skipped with a warning naming the file, never served and never
raised.

``DiskLRUPromptCache(disk, max_size, max_bytes)`` is an ``LRUPromptCache``
that writes every entry it evicts (``_evict``, ``prompt_cache_store``) to
``disk`` and, where memory holds less of a prompt than the disk tier,
serves it from there.
"""

from typing import TYPE_CHECKING, Any, List, Optional

from mlx_lm.models.cache import LRUPromptCache

from ._registry import Patch, cache_class, targets
from .prompt_cache_dir import PromptCacheDir

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    import errno
    import fcntl
    import json
    import logging
    import os
    import queue
    import threading
    import time
    import zlib

    import mlx.core as mx
    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

    from .host_export import prompt_cache_to_host
    from .prompt_cache_files import (
        _prompt_cache_from_arrays,
        prompt_cache_layout,
        prompt_cache_mismatch,
    )


class DiskPromptCache(PromptCacheDir):
    """Prompt caches in ``directory``, at most ``max_bytes`` of files.

    Each file is a ``.safetensors`` prompt cache named by a hash of its model
    key and tokens; its metadata holds both, the tokens it can trim, a
    checksum of its whole header (``_manifest``) and a CRC-32 of its data.
    ``put`` returns once its host copy is taken (host memory holds at most
    six queued copies): ``flush`` waits for the writes, ``close`` ends the
    writer. Several processes may share ``directory``: the budget is counted
    over its files under an ``flock`` of the directory, the least recently
    used (oldest mtime) go first.
    """

    def __init__(self, directory: str, max_bytes: int = 1 << 63):
        PromptCacheDir.__init__(self, directory, max_bytes)
        self._layouts = {}  # model key -> prompt_cache_layout of its own caches
        self._queue = queue.Queue(maxsize=4)
        self._writer = threading.Thread(target=self._write_loop, daemon=True)
        self._writer.start()

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
        model = self._model_key(model)
        self._learn(model, cache)
        metadata = {
            "model": model,
            "tokens": json.dumps(tokens),
            "trimmable": str(trimmable),
        }
        host = prompt_cache_to_host(cache, metadata)
        entry = (model, tokens, trimmable)
        self._queue.put((self._name(model, tokens), entry, host))

    def learn(self, model: Any, cache: List[Any]):
        """Take ``cache`` as what ``model``'s caches look like: an entry of
        ``model`` with other layers or head dims is a miss."""
        self._learn(self._model_key(model), cache)

    def _learn(self, key: str, cache: List[Any]):
        if key not in self._layouts:
            try:
                self._layouts[key] = prompt_cache_layout(cache)
            except Exception:
                pass  # a cache kind it cannot describe: nothing to compare

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
        header = host.header()
        host.metadata["0.manifest"] = self._manifest(header)
        crc = 0
        for k in sorted(host.arrays):
            a = host.arrays[k]
            crc = zlib.crc32(a.astype(a.dtype.newbyteorder("<"), copy=False), crc)
        host.metadata["0.crc32"] = str(crc)  # next to put's metadata
        path = os.path.join(self.directory, name)
        temp = f"{path}.{os.getpid()}-{id(self):x}.tmp"
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # not stale while it is written
            while True:
                try:
                    host.save(temp)
                    break
                except OSError as e:
                    if e.errno not in (errno.ENOSPC, errno.EDQUOT):
                        raise
                    # The disk is full: the oldest entries make room.
                    need = host.nbytes + len(json.dumps(header)) + 64
                    self._lock_dir()
                    try:
                        if not self._shrink(free=need):
                            raise
                    finally:
                        self._unlock_dir()
            self._lock_dir()
            try:
                os.replace(temp, path)
                now = time.time_ns()  # finer than the file system's clock
                os.utime(path, ns=(now, now))
                with self._lock:
                    self._add(name, (*entry, os.path.getsize(path)))
                self._shrink()
            finally:
                self._unlock_dir()
        finally:
            if os.path.lexists(temp):
                os.remove(temp)
            os.close(fd)

    def _load(self, name: str):
        """The cache in file ``name``, or ``None`` (warned) if it is not sound:
        its header must be the one indexed and pass every check, its data
        its CRC, each layer hold the tokens its header names."""
        path = os.path.join(self.directory, name)
        try:
            import numpy as np

            entry, header = self._read_header(path, full=True)
            if entry != self._files.get(name):
                raise ValueError("it changed since it was indexed")
            arrays, metadata = mx.load(path, return_metadata=True)
            if metadata != header["__metadata__"] or any(
                k not in header
                or list(a.shape) != header[k]["shape"]
                or a.dtype != getattr(mx, self.dtypes[header[k]["dtype"]])
                for k, a in arrays.items()
            ):
                raise ValueError("it changed while it was read")
            mx.eval(list(arrays.values()))
            crc = 0
            for k in sorted(arrays):  # as bits, as _write saw them
                bits = getattr(mx, f"uint{8 * arrays[k].dtype.size}")
                crc = zlib.crc32(np.asarray(arrays[k].view(bits)), crc)
            if crc != int(metadata["0.crc32"]):
                raise ValueError("its data does not match its CRC-32")
            cache = _prompt_cache_from_arrays(arrays, metadata, path)[0]
            for i, c in enumerate(cache):
                offset = getattr(c, "offset", None)
                if isinstance(offset, int) and offset != len(entry[1]):
                    raise ValueError(
                        f"layer {i} holds {offset} tokens, its header {len(entry[1])}"
                    )
            return cache
        except Exception as e:
            logging.warning(f"[prompt cache] skipping {path}: {e!r}")
            return None

    def get(self, model: Any, tokens: List[int], cached: int = 0):
        """``(cache, tokens left to prefill)`` from the entry that reuses the
        most of ``tokens`` for ``model``, if it reuses more than ``cached``;
        else ``None``."""
        model = self._model_key(model)
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
            expected = self._layouts.get(model)
            if cache is not None and expected is not None:
                why = prompt_cache_mismatch(expected, cache)
                if why is not None:
                    logging.warning(f"[prompt cache] skipping {name}: {why}")
                    cache = None
            if cache is not None and len(stored) > n:
                if can_trim_prompt_cache(cache, len(stored) - n):
                    trim_prompt_cache(cache, len(stored) - n)
                else:
                    logging.warning(f"[prompt cache] skipping {name}: cannot trim")
                    cache = None
            with self._lock:
                if name not in self._files:
                    continue
                if cache is None:
                    self._drop(name)
                    continue
            try:  # the most recently used
                now = time.time_ns()
                os.utime(os.path.join(self.directory, name), ns=(now, now))
            except OSError:
                pass
            return cache, tokens[n:]

    def flush(self):
        """Wait until every queued cache is written."""
        self._queue.join()

    def close(self):
        """Write what is queued and end the writer thread."""
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()
            os.close(self._dir_fd)


class DiskLRUPromptCache(LRUPromptCache):
    """An ``LRUPromptCache`` that writes what it evicts to ``disk`` (a
    ``DiskPromptCache``) and reads from it where memory has less. With
    ``bits``, files hold the entries as quantized at rest, dequantized on
    fetch."""

    def __init__(
        self,
        disk: "DiskPromptCache",
        max_size: int = 10,
        max_bytes: int = 1 << 63,
        *,
        bits: Optional[int] = None,
        group_size: int = 64,
    ):
        LRUPromptCache.__init__(
            self, max_size, max_bytes, bits=bits, group_size=group_size
        )
        self.disk = disk

    def fetch_nearest_cache(self, model: Any, tokens: List[int]):
        cache, rest = LRUPromptCache.fetch_nearest_cache(self, model, tokens)
        if rest:
            try:
                found = self.disk.get(model, tokens, cached=len(tokens) - len(rest))
            except Exception as e:  # a miss, never the generation thread's end
                logging.warning(f"[prompt cache] disk tier failed: {e!r}")
                found = None
            if found is not None:
                return self._working(found[0]), found[1]
        return cache, rest

    def insert_cache(self, model: Any, tokens: List[int], prompt_cache, **kwargs):
        # What the disk tier serves this model must look like its own caches.
        try:
            self.disk.learn(model, prompt_cache)
        except Exception as e:  # never the generation thread's end
            logging.warning(f"[prompt cache] disk tier failed: {e!r}")
        return LRUPromptCache.insert_cache(self, model, tokens, prompt_cache, **kwargs)

    def _evict(self):
        model, tokens, entry = LRUPromptCache._evict(self)
        try:
            self.disk.put(model, tokens, entry.prompt_cache)
        except Exception as e:  # not written: a miss later, never an error now
            logging.warning(f"[prompt cache] disk tier failed: {e!r}")
        return model, tokens, entry


# Written as they read in mlx_lm/models/cache.py, and run there.
DiskPromptCache = cache_class("mlx_lm.models.cache", DiskPromptCache, PromptCacheDir)
DiskLRUPromptCache = cache_class(
    "mlx_lm.models.cache", DiskLRUPromptCache, LRUPromptCache
)

PATCH = Patch(
    "prompt_cache_disk",
    "DiskPromptCache: prompt caches on disk, written by a background thread, "
    "bit-exact, bounded, found again after a restart; served only if every "
    "header field is verified and the weights are the same, the budget held "
    "for a directory replicas share",
    targets("mlx_lm.models.cache", DiskPromptCache, DiskLRUPromptCache),
    requires=("mlx_lm.models.cache:LRUPromptCache._evict",),
)
