"""A directory of prompt-cache files that servers can share.

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

from .._registry import Patch, cache_class, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    import mlx.core as mx
    from mlx_lm.models.cache import PromptTrie


# Written as it reads in mlx_lm/models/cache.py, and run there.
class PromptCacheDir:
    """Entry files in ``directory``, at most ``max_bytes`` of them, counted
    under an ``flock`` of the directory (see the module). Files are written
    with ``mode`` (0600: the cached prompts are their users'), a directory
    made with x where ``mode`` has r (0700); both less the umask."""

    # Bytes of header a scan reads at most (a 1M-token prompt takes ~8 MB).
    header_limit = 64 << 20

    # Seconds an unlocked temporary file is left to its writer.
    temp_grace = 10.0

    # Errors opening or reading a file that say it is not one to read: it is
    # set aside (``_set_aside``) so a write can put an entry or block there.
    unreadable = (
        errno.EACCES, errno.EPERM, errno.ELOOP, errno.EISDIR, errno.ENXIO,
        errno.ENODEV, errno.EIO,
    )  # fmt: skip

    # Threads reading an entry's data; bytes a read at most (a multiple of 8).
    read_threads = 8
    read_chunk = 16 << 20

    # Bytes a second a restore is taken to read (and verify, and build)
    # before one is measured: an NVMe disk read in parallel.
    read_prior = 2e9

    # safetensors dtype: MLX dtype
    dtypes = {
        "BOOL": "bool", "U8": "uint8", "U16": "uint16", "U32": "uint32",
        "U64": "uint64", "I8": "int8", "I16": "int16", "I32": "int32",
        "I64": "int64", "F16": "float16", "BF16": "bfloat16",
        "F32": "float32", "F64": "float64",
    }  # fmt: skip

    def __init__(self, directory: str, max_bytes: int = 1 << 63, mode: int = 0o600):
        if not isinstance(max_bytes, int) or max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes!r}")
        self.mode = mode  # of the files written; a directory made: x where r
        try:
            os.makedirs(directory, mode | (mode & 0o444) >> 2, exist_ok=True)
            # Locked while the directory's files are counted and removed.
            self._dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError as e:
            raise ValueError(
                f"prompt cache directory {directory}: {e.strerror or e}"
            ) from None
        self.directory = directory
        self.max_bytes = max_bytes
        self.scope = None  # what else shapes an entry: in every model key
        self._lock = threading.Lock()
        self._dir_lock = threading.Lock()
        self._trie = PromptTrie()
        # name -> (model, tokens, tokens it can trim, file bytes)
        self._files = {}
        self._pending = {}  # name -> what is queued to be written as it
        self._n_bytes = 0  # every entry file in the directory, at the last count
        self._looked = (None, 0.0)  # the directory's mtime, when, at the last look
        self._unsound = set()  # (name, mtime, size) of files skipped with a warning
        self._digests = self._known_digests()  # (directory, files' stats) -> digest
        self._digest_lock = threading.Lock()  # one reader of a model's files
        self._reading = set()  # the digests read on threads of their own
        self._read = [0, 0.0]  # [bytes, seconds] restored, older ones weighing half
        self._pool = (0, None)  # (read_threads, the threads reading entries)
        self._lock_dir()
        try:
            for name, entry in self._scan():
                self._add(name, entry)
            self._shrink()
        finally:
            self._unlock_dir()

    def __len__(self):
        return len(self._files)

    @property
    def nbytes(self):
        return self._n_bytes

    @property
    def read_rate(self):
        """Bytes a second restores took, the recent ones weighing most;
        ``read_prior`` until one is measured."""
        return self._read[0] / self._read[1] if self._read[1] else self.read_prior

    @staticmethod
    def _observe(totals: list, amount: float, seconds: float):
        """Fold ``amount`` done in ``seconds`` into ``totals`` ([amount,
        seconds]), what was there weighing half."""
        totals[0] = totals[0] / 2 + amount
        totals[1] = totals[1] / 2 + seconds

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
    def _is_block(name: str):  # prompt_cache_disk_blocks
        return (
            len(name) == 50
            and name.endswith(".block.safetensors")
            and all(c in "0123456789abcdef" for c in name[:32])
        )

    def _is_temp(self, name: str):
        stem = name.rsplit(".", 2)[0]
        return name.endswith(".tmp") and (self._is_entry(stem) or self._is_block(stem))

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

    def _model_key(self, model: Any, wait: bool = True):
        """``model`` as entries name it. A server's key (model, adapter and
        draft paths) names each local directory by a digest of its files,
        so other weights at the same path are other entries; any other key
        is its ``repr``. With a ``scope``, the key is ``(key, scope)``.
        With ``wait=False``, ``None`` until a digest read on a thread of
        its own is known (a request does not wait for 16 GB of weights)."""
        if isinstance(model, tuple):
            parts = []
            for x in model:
                if isinstance(x, str) and os.path.isdir(x):
                    x = self._digest(x, wait)
                    if x is None:
                        return None
                parts.append(x)
            model = tuple(parts)
        return repr(model if self.scope is None else (model, self.scope))

    def _digest(self, directory: str, wait: bool = True):
        """A digest of the names and contents of the files in ``directory``
        (weights, config, tokenizer, adapter), hashed again only where a
        file's size, mtime, ctime or inode changed; ``None`` if another
        it is not known yet and ``wait`` is false (it is read on a thread).
        """
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
        if key in self._digests:
            return self._digests[key]
        if not wait:  # read on a thread of its own, once
            with self._lock:
                reading, self._reading = key in self._reading, self._reading | {key}
            if not reading:
                threading.Thread(
                    target=self._digest, args=(directory,), daemon=True
                ).start()
            return None
        with self._digest_lock:
            if key not in self._digests:
                h = hashlib.sha256()
                for (name, path), st in zip(files, stats):
                    h.update(json.dumps([name, st[1]]).encode())
                    with open(path, "rb") as f:
                        h.update(hashlib.file_digest(f, "sha256").digest())
                self._digests[key] = "sha256:" + h.hexdigest()[:32]
                self._keep_digests()
        return self._digests[key]

    # The digests read, by the files' stats: a restart does not read the
    # weights again (16 GB for an 8B model) while their stats are the same.
    digests_file = ".model-digests.json"

    def _known_digests(self) -> dict:
        """The digests ``digests_file`` holds ({} if it is not a regular
        file holding them)."""
        path = os.path.join(self.directory, self.digests_file)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return {}
                known = json.loads(f.read(1 << 20))
        except (OSError, ValueError):
            return {}
        ok = isinstance(known, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in known.items()
        )
        return known if ok else {}

    def _keep_digests(self):
        """Write the digests read to ``digests_file`` (best effort)."""
        path = os.path.join(self.directory, self.digests_file)
        temp = f"{path}.{os.getpid()}-{id(self):x}"
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            with os.fdopen(os.open(temp, flags, self.mode), "w") as f:
                json.dump(self._digests, f)
            os.replace(temp, path)
        except OSError as e:
            logging.warning(f"[prompt cache] could not write {path}: {e!r}")
            if os.path.lexists(temp):
                os.remove(temp)

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
                if self._is_temp(e.name):
                    self._remove_stale(e.path)
                    continue
                if self._is_block(e.name):
                    continue  # counted by _shrink, read with its entries
                if e.name.startswith(self.digests_file):
                    continue  # the model digests known (and one being written)
                if not stat.S_ISREG(st.st_mode):
                    raise ValueError("not a regular file")
                if not self._is_entry(e.name):
                    raise ValueError("not named as a prompt cache entry")
                found.append((st.st_mtime_ns, e.name, self._read_header(e.path)))
            except Exception as ex:
                logging.warning(f"[prompt cache] skipping {e.path}: {ex!r}")
        return [(name, entry) for _, name, entry in sorted(found)]

    def _refresh(self):
        """Index the files other processes wrote (renamed into place: never
        torn), forget those they removed; once the directory changed."""
        mtime = os.stat(self.directory).st_mtime_ns
        if self._looked[0] == mtime and time.monotonic() - self._looked[1] < 1:
            return
        self._looked, present = (mtime, time.monotonic()), set()
        for e in os.scandir(self.directory):
            if self._is_entry(e.name):
                present.add(e.name)
                try:
                    st = os.lstat(e.path)
                    key = (e.name, st.st_mtime_ns, st.st_size)
                    if e.name not in self._files and key not in self._unsound:
                        entry = self._read_header(e.path)
                        with self._lock:
                            if e.name not in self._files:
                                self._add(e.name, entry)
                except FileNotFoundError:
                    pass
                except Exception as ex:
                    self._unsound.add(key)
                    logging.warning(f"[prompt cache] skipping {e.path}: {ex!r}")
        with self._lock:
            self._forget(present)

    def _remove_stale(self, path: str):
        """Remove the temporary file ``path`` if no writer holds its lock
        (its writer died) and it is older than ``temp_grace``; whether it
        is gone."""
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or time.time() - st.st_mtime < (
                self.temp_grace
            ):
                return False
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.remove(path)
                logging.info(f"[prompt cache] removed {path}, left by a writer")
                return True
            finally:
                os.close(fd)
        except FileNotFoundError:
            return True
        except OSError:
            return False  # its writer holds it

    def _present(self, name: str):
        """Whether ``name`` is a regular file this process can open; anything
        else there (a link, a directory, a FIFO, a file it may not read) is
        set aside, so a write can put the file there. Called with the
        directory locked."""
        path = os.path.join(self.directory, name)
        try:
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                try:
                    os.close(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK))
                    return True
                except OSError as e:
                    if e.errno not in self.unreadable:
                        raise
        except FileNotFoundError:
            return False
        self._set_aside(name, st)
        return False

    def _set_aside(self, name: str, st):
        """Remove file ``name`` if it is still the one ``st`` (its ``lstat``)
        describes, not one a writer renamed in since; a directory that is
        not empty is renamed ``<name>.<ns>.unsound``. Warned; called with the
        directory locked."""
        path = os.path.join(self.directory, name)
        try:
            now = os.lstat(path)
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return
            if stat.S_ISDIR(now.st_mode):
                try:
                    os.rmdir(path)
                except OSError:
                    os.rename(path, f"{path}.{time.time_ns()}.unsound")
            else:
                os.remove(path)
            logging.warning(f"[prompt cache] removed {path}: it cannot be read")
        except FileNotFoundError:
            pass
        except OSError as e:
            logging.warning(f"[prompt cache] could not remove {path}: {e!r}")

    def _remove_unsound(self, name: str, st):
        """``_set_aside`` with the directory locked (a reader's)."""
        self._lock_dir()
        try:
            self._set_aside(name, st)
        finally:
            self._unlock_dir()

    def _read_header(self, path: str, full: bool = False, fd=None):
        """``(model, tokens, tokens it can trim, file bytes)`` from the
        header of the entry file ``path`` (with ``full``, the header too),
        read without following links or blocking (or from ``fd``, open on
        it), at most ``header_limit`` bytes of it, every field checked."""
        own = fd is None
        if own:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        try:
            header, size = self._safetensors_header(fd)
        finally:
            if own:
                os.close(fd)
        meta = header["__metadata__"]
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
        entry = (model, tokens, int(trimmable), size)
        return (entry, header) if full else entry

    def _safetensors_header(self, fd: int):
        """``(header, file bytes)`` of the file open on ``fd``: a regular
        file, a header of at most ``header_limit`` bytes matching its
        manifest, each array's dtype, shape and offsets well formed, the
        arrays filling the file without gaps."""
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        size = st.st_size
        n = int.from_bytes(os.pread(fd, 8, 0).ljust(8, b"\0"), "little")
        if not 0 < n <= min(size - 8, self.header_limit):
            raise ValueError(f"a header of {n} bytes in a file of {size}")
        header = json.loads(os.pread(fd, n, 8))
        if not isinstance(header, dict) or not isinstance(
            header.get("__metadata__"), dict
        ):
            raise ValueError("no metadata")
        if header["__metadata__"].get("0.manifest") != self._manifest(header):
            raise ValueError("its header does not match its manifest")
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
        return header, size

    def _read_arrays(self, fd: int, header: dict, each):
        """Call ``each(key, bytes)`` for each array of the entry file open on
        ``fd`` (``header``, its checked header), in file order, each as soon
        as it is read: ``read_threads`` threads read ``read_chunk`` bytes at
        a time into preallocated numpy buffers and check each chunk: its
        CRC-32 (zlib releases the GIL) and, for floats, that no exponent is
        all ones (NaN or infinite). Raises ``ValueError`` where a float is
        not finite and, once all are read, where their CRC-32 is not the
        header's (``_write``'s: the arrays' bytes in sorted key order, chunks
        joined as zlib's ``crc32_combine`` joins them)."""
        from concurrent.futures import ThreadPoolExecutor, wait

        import numpy as np

        base = 8 + int.from_bytes(os.pread(fd, 8, 0), "little")
        spans = {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}
        shifts = {}  # bytes -> _crc32_shift(bytes): a few sizes recur

        def combine(crc1, crc2, n):
            if n not in shifts:
                shifts[n] = self._crc32_shift(n)
            return self._crc32_times(shifts[n], crc1) ^ crc2

        # safetensors dtype: its bits, and the exponent all ones in NaN and inf
        floats = {
            "BF16": np.array(0x7F80, np.uint16),
            "F16": np.array(0x7C00, np.uint16),
            "F32": np.array(0x7F800000, np.uint32),
            "F64": np.array(0x7FF0000000000000, np.uint64),
        }

        def read(key, view, at):
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], at + done)
                if n == 0:
                    raise ValueError("it was truncated while it was read")
                done += n
            exponent = floats.get(header[key]["dtype"])
            if exponent is not None:
                bits = np.frombuffer(view, exponent.dtype)
                if (bits & exponent).max(initial=0) == exponent:
                    raise ValueError(f"array {key} holds NaN or infinite values")
            return zlib.crc32(view)

        if self._pool[0] != self.read_threads:  # kept: threads take ms to start
            self._pool = (self.read_threads, ThreadPoolExecutor(self.read_threads))
        pool, futures = self._pool[1], []
        try:
            jobs, crcs = [], {}
            for k, (start, stop) in sorted(spans.items(), key=lambda x: x[1]):
                data = np.empty(stop - start, np.uint8)
                view, step = memoryview(data), self.read_chunk
                parts = [
                    (pool.submit(read, k, view[i : i + step], base + start + i),
                     len(view[i : i + step]))
                    for i in range(0, len(data), step)
                ]  # fmt: skip
                jobs.append((k, data, parts))
                futures += [part for part, _ in parts]
            for i, (k, data, parts) in enumerate(jobs):
                jobs[i], crcs[k] = None, 0  # its buffer freed once used
                for part, n in parts:
                    crcs[k] = combine(crcs[k], part.result(), n)
                each(k, data)
        finally:  # on any error, no thread reads ``fd`` once this returns
            for part in futures:
                part.cancel()
            wait(futures)
        crc = 0
        for k in sorted(crcs):
            crc = combine(crc, crcs[k], spans[k][1] - spans[k][0])
        if crc != int(header["__metadata__"].get("0.crc32", "-1")):
            raise ValueError("its data does not match its CRC-32")

    @staticmethod
    def _crc32_times(a: int, b: int):
        """``a`` times ``b`` modulo the CRC-32 polynomial, bit-reflected (x^0
        is 1 << 31): CRC-32 of ``A + B`` is ``crc(A)`` times x^(8 len(B))
        plus ``crc(B)``, as zlib's ``crc32_combine`` computes it."""
        p, m = 0, 1 << 31
        while a:
            if a & m:
                p, a = p ^ b, a ^ m
            m >>= 1
            b = (b >> 1) ^ 0xEDB88320 if b & 1 else b >> 1
        return p

    @classmethod
    def _crc32_shift(cls, n: int):
        """x^(8n) modulo the CRC-32 polynomial: what ``n`` bytes shift by."""
        product, power = 1 << 31, 1 << 23  # x^0, x^8
        while n:
            if n & 1:
                product = cls._crc32_times(power, product)
            n >>= 1
            if n:
                power = cls._crc32_times(power, power)
        return product

    def _add(self, name: str, entry: tuple):
        if name in self._files:
            self._drop(name)
        self._files[name] = entry
        self._trie.add(entry[0], entry[1], name)

    def _drop(self, name: str):
        model, tokens, _, _ = self._files.pop(name)
        self._trie.pop(model, tokens)

    def _forget(self, present: set):
        """Drop the entries another process removed: written, not in ``present``."""
        for name in set(self._files) - present - set(self._pending):
            self._drop(name)


PromptCacheDir = cache_class("mlx_lm.models.cache", PromptCacheDir)

PATCH = Patch(
    "prompt_cache_dir",
    "PromptCacheDir: prompt-cache files in a directory servers share, verified "
    "by a manifest, scanned without blocking, within one budget",
    targets(
        "mlx_lm.models.cache",
        errno,
        fcntl,
        hashlib,
        json,
        logging,
        queue,
        stat,
        threading,
        time,
        zlib,
        PromptCacheDir,
    ),
)
