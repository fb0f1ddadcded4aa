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
thread writes it (a locked temporary file renamed into place), named by a
hash of the model key and tokens. ``get`` returns the longest stored prefix
of a prompt (or a longer entry trimmed to it, as
``LRUPromptCache.fetch_nearest_cache`` does) as a working cache, bit for
bit, and the tokens left to prefill.

An entry is served only if everything that shapes it is verified: its
header's manifest digest covers every field (dtypes, shapes, offsets,
tokens, trim count, cache classes), its CRC-32 its data, its name the hash
of its model and tokens, and each layer holds the tokens the header names.
A server's model key names the weights, not the path: a digest of the files
in the model, adapter and draft directories. Anything else (a corrupt,
edited, truncated or foreign file, a link, a FIFO, a header past
``header_limit``) is skipped with a warning naming it, never served and
never raised. The directory holds at most ``max_bytes`` of entries, counted
over every file in it under an ``flock`` (replicas may share it), the least
recently used go first; it is scanned on construction, so entries survive a
restart, and temporary files a killed writer left are removed. On a full
disk the oldest entries make room and writing goes on.

``DiskLRUPromptCache(disk, max_size, max_bytes)`` is an ``LRUPromptCache``
that writes every entry it evicts (``_evict``, ``prompt_cache_store``) to
``disk`` and, where memory holds less of a prompt than the disk tier,
serves it from there.
"""

import errno
import fcntl
import hashlib
import json
import logging
import os
import queue
import stat
import threading
import time
import zlib
from typing import TYPE_CHECKING, Any, List

from mlx_lm.models.cache import LRUPromptCache

from ._registry import Patch, cache_class, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    import mlx.core as mx
    from mlx_lm.models.cache import PromptTrie, can_trim_prompt_cache, trim_prompt_cache

    from .host_export import prompt_cache_to_host
    from .prompt_cache_files import (
        _prompt_cache_from_arrays,
        prompt_cache_layout,
        prompt_cache_mismatch,
    )


class DiskPromptCache:
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

    # Bytes of header a scan reads at most (a 1M-token prompt takes ~8 MB).
    header_limit = 64 << 20
    # Seconds an unlocked temporary file is left to its writer.
    temp_grace = 10.0
    # safetensors dtype: MLX dtype
    dtypes = {
        "BOOL": "bool", "U8": "uint8", "U16": "uint16", "U32": "uint32",
        "U64": "uint64", "I8": "int8", "I16": "int16", "I32": "int32",
        "I64": "int64", "F16": "float16", "BF16": "bfloat16",
        "F32": "float32", "F64": "float64",
    }  # fmt: skip

    def __init__(self, directory: str, max_bytes: int = 1 << 63):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes!r}")
        try:
            os.makedirs(directory, exist_ok=True)
            # Locked while the directory's files are counted and removed.
            self._dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise ValueError(
                f"prompt cache directory {directory}: {e.strerror or e}"
            ) from None
        self.directory = directory
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._dir_lock = threading.Lock()
        self._trie = PromptTrie()
        # name -> (model, tokens, tokens it can trim, file bytes)
        self._files = {}
        self._n_bytes = 0  # every entry file in the directory, at the last count
        self._digests = {}  # (directory, its files' stats) -> digest
        self._layouts = {}  # model key -> prompt_cache_layout of its own caches
        self._lock_dir()
        try:
            for name, entry in self._scan():
                self._add(name, entry)
            self._shrink()
        finally:
            self._unlock_dir()
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

    @staticmethod
    def _is_entry(name: str):
        return (
            len(name) == 44
            and name.endswith(".safetensors")
            and all(c in "0123456789abcdef" for c in name[:32])
        )

    @staticmethod
    def _manifest(header: dict):
        """A digest of everything in ``header`` but the two checksums: each
        array's dtype, shape and offsets, the model, tokens, trim count,
        cache classes and scalars."""
        header = dict(header)
        meta = dict(header["__metadata__"])
        meta.pop("0.manifest", None)
        meta.pop("0.crc32", None)
        header["__metadata__"] = meta
        text = json.dumps(header, sort_keys=True).encode()
        return hashlib.sha256(text).hexdigest()[:32]

    def _model_key(self, model: Any):
        """``model`` as entries name it. A server's key (model, adapter and
        draft paths) names each local directory by a digest of its files,
        so other weights at the same path are other entries; any other key
        is its ``repr``."""
        if not isinstance(model, tuple):
            return repr(model)
        return repr(
            tuple(
                self._digest(x) if isinstance(x, str) and os.path.isdir(x) else x
                for x in model
            )
        )

    def _digest(self, directory: str):
        """A digest of the names and contents of the files in ``directory``
        (weights, config, tokenizer, adapter), hashed again only where a
        file's size, mtime, ctime or inode changed."""
        files = sorted(
            (e.name, e.path)
            for e in os.scandir(directory)
            if not e.name.startswith(".") and e.is_file()
        )
        stats = []
        for name, path in files:
            st = os.stat(path)
            stats.append([name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
        key = json.dumps([os.path.abspath(directory), stats])
        if key not in self._digests:
            h = hashlib.sha256()
            for (name, path), st in zip(files, stats):
                h.update(json.dumps([name, st[1]]).encode())
                with open(path, "rb") as f:
                    h.update(hashlib.file_digest(f, "sha256").digest())
            self._digests[key] = "sha256:" + h.hexdigest()[:32]
        return self._digests[key]

    def _lock_dir(self):
        self._dir_lock.acquire()
        fcntl.flock(self._dir_fd, fcntl.LOCK_EX)

    def _unlock_dir(self):
        fcntl.flock(self._dir_fd, fcntl.LOCK_UN)
        self._dir_lock.release()

    def _scan(self):
        """``(name, entry)`` of every sound entry file, oldest first. Only
        regular files named as entries are opened; each other file is warned
        about and left, each stale temporary file removed."""
        found = []
        for e in os.scandir(self.directory):
            try:
                st = os.lstat(e.path)
                if e.name.endswith(".tmp") and self._is_entry(e.name[:44]):
                    self._remove_stale(e.path)
                    continue
                if not stat.S_ISREG(st.st_mode):
                    raise ValueError("not a regular file")
                if not self._is_entry(e.name):
                    raise ValueError("not named as a prompt cache entry")
                found.append((st.st_mtime_ns, e.name, self._read_header(e.path)))
            except Exception as ex:
                logging.warning(f"[prompt cache] skipping {e.path}: {ex!r}")
        return [(name, entry) for _, name, entry in sorted(found)]

    def _remove_stale(self, path: str):
        """Remove the temporary file ``path`` if no writer holds its lock
        (its writer died) and it is older than ``temp_grace``."""
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < (
                self.temp_grace
            ):
                return
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.remove(path)
                logging.info(f"[prompt cache] removed {path}, left by a writer")
            finally:
                os.close(fd)
        except OSError:
            pass  # its writer holds it, or it is gone

    def _read_header(self, path: str, full: bool = False):
        """``(model, tokens, tokens it can trim, file bytes)`` from the
        header of the entry file ``path`` (with ``full``, the header too),
        read without following links or blocking, at most ``header_limit``
        bytes of it, every field checked."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError("not a regular file")
            size = st.st_size
            n = int.from_bytes(os.pread(fd, 8, 0).ljust(8, b"\0"), "little")
            if not 0 < n <= min(size - 8, self.header_limit):
                raise ValueError(f"a header of {n} bytes in a file of {size}")
            raw = os.pread(fd, n, 8)
        finally:
            os.close(fd)
        header = json.loads(raw)
        if not isinstance(header, dict) or not isinstance(
            header.get("__metadata__"), dict
        ):
            raise ValueError("no metadata")
        meta = header["__metadata__"]
        if meta.get("0.manifest") != self._manifest(header):
            raise ValueError("its header does not match its manifest")
        model, tokens = meta.get("0.model"), json.loads(meta.get("0.tokens", "null"))
        trimmable = meta.get("0.trimmable", "")
        if not (
            isinstance(model, str)
            and isinstance(tokens, list)
            and all(type(t) is int and t >= 0 for t in tokens)
            and trimmable.isdigit()
            and int(trimmable) <= len(tokens)
        ):
            raise ValueError("its model, tokens or trim count are malformed")
        if os.path.basename(path) != self._name(model, tokens):
            raise ValueError("its name is not the hash of its model and tokens")
        spans = []
        for k, v in header.items():
            if k == "__metadata__":
                continue
            shape, offsets = v.get("shape"), v.get("data_offsets")
            if not (
                v.get("dtype") in self.dtypes
                and isinstance(shape, list)
                and all(type(d) is int and d >= 0 for d in shape)
                and isinstance(offsets, list)
                and len(offsets) == 2
                and all(type(o) is int for o in offsets)
            ):
                raise ValueError(f"array {k!r} has a malformed dtype, shape or offsets")
            count = 1
            for d in shape:
                count *= d
            itemsize = getattr(mx, self.dtypes[v["dtype"]]).size
            if offsets[1] - offsets[0] != count * itemsize:
                raise ValueError(f"array {k!r} has offsets that do not fit its shape")
            spans.append(offsets)
        end = 0
        for start, stop in sorted(spans):
            if start != end:
                raise ValueError("its arrays' offsets leave gaps or overlap")
            end = stop
        if size != 8 + n + end:
            raise ValueError(f"{size} bytes where its header needs {8 + n + end}")
        entry = (model, tokens, int(trimmable), size)
        return (entry, header) if full else entry

    def _add(self, name: str, entry: tuple):
        if name in self._files:
            self._drop(name)
        self._files[name] = entry
        self._trie.add(entry[0], entry[1], name)

    def _drop(self, name: str):
        model, tokens, _, _ = self._files.pop(name)
        self._trie.pop(model, tokens)

    def _shrink(self, free: int = 0):
        """Count every entry file in the directory (other processes' too)
        and remove the least recently used until they fit ``max_bytes`` and,
        with ``free``, take ``free`` fewer bytes; return the bytes removed.
        Called with the directory locked."""
        found = []
        for e in os.scandir(self.directory):
            if self._is_entry(e.name):
                try:
                    st = os.lstat(e.path)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.append((st.st_mtime_ns, e.name, st.st_size))
            elif e.name.endswith(".tmp") and self._is_entry(e.name[:44]):
                self._remove_stale(e.path)
        total = sum(size for _, _, size in found)
        limit, removed = min(self.max_bytes, total - free), 0
        with self._lock:
            present = {name for _, name, _ in found}
            for name in [n for n in self._files if n not in present]:
                self._drop(name)  # another process removed it
            for _, name, size in sorted(found):
                if total - removed <= limit:
                    break
                try:
                    os.remove(os.path.join(self.directory, name))
                except FileNotFoundError:
                    pass
                except OSError as e:
                    logging.warning(f"[prompt cache] could not remove {name}: {e!r}")
                    continue
                removed += size
                if name in self._files:
                    self._drop(name)
        self._n_bytes = total - removed
        return removed

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
    ``DiskPromptCache``) and reads from it where memory has less."""

    def __init__(
        self, disk: DiskPromptCache, max_size: int = 10, max_bytes: int = 1 << 63
    ):
        LRUPromptCache.__init__(self, max_size, max_bytes)
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
                return found
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
DiskPromptCache = cache_class("mlx_lm.models.cache", DiskPromptCache)
DiskLRUPromptCache = cache_class(
    "mlx_lm.models.cache", DiskLRUPromptCache, LRUPromptCache
)

PATCH = Patch(
    "prompt_cache_disk",
    "DiskPromptCache: prompt caches on disk, written by a background thread, "
    "bit-exact, bounded, found again after a restart; served only if every "
    "header field is verified and the weights are the same, the budget held "
    "for a directory replicas share",
    targets(
        "mlx_lm.models.cache",
        errno,
        fcntl,
        hashlib,
        json,
        logging,
        os,
        queue,
        stat,
        threading,
        time,
        zlib,
        DiskPromptCache,
        DiskLRUPromptCache,
    ),
    requires=("mlx_lm.models.cache:LRUPromptCache._evict",),
)
