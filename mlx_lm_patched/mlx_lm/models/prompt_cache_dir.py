"""A directory of prompt-cache files that servers can share: entry files
named by a hash of their model key and tokens, indexed only where their
header's manifest matches, within one byte budget under an ``flock``."""

import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, List

from .cache import PromptTrie
from .prompt_cache_read import PromptCacheReader


def _file_digest(path: str, chunk: int = 1 << 24) -> bytes:
    """The SHA-256 of the SHA-256s of ``path``'s ``chunk``-byte runs, read
    and hashed on up to 8 threads (both let go of the GIL): a model's 16 GB
    took 14 s on one thread of an H200's host, and the disk tier is off
    until its weights' digest is known."""

    def run(start):
        with open(path, "rb") as f:
            f.seek(start)
            return hashlib.sha256(f.read(chunk)).digest()

    starts = range(0, max(os.path.getsize(path), 1), chunk)
    with ThreadPoolExecutor(min(8, os.cpu_count() or 1, len(starts))) as pool:
        return hashlib.sha256(b"".join(pool.map(run, starts))).digest()


class PromptCacheDir(PromptCacheReader):
    """Entry files in ``directory``, at most ``max_bytes`` of them, counted
    under an ``flock`` of the directory (see the module). Files are written
    with ``mode`` (0600: the cached prompts are their users'), a directory
    made with x where ``mode`` has r (0700); both less the umask."""

    # Seconds an unlocked temporary file is left to its writer.
    temp_grace = 10.0

    # Errors opening or reading a file that say it is not one to read: it is
    # set aside (``_set_aside``) so a write can put an entry or block there.
    unreadable = (
        errno.EACCES, errno.EPERM, errno.ELOOP, errno.EISDIR, errno.ENXIO,
        errno.ENODEV, errno.EIO,
    )  # fmt: skip

    # Bytes a second a restore is taken to read (and verify, and build)
    # before one is measured: an NVMe disk read in parallel.
    read_prior = 2e9
    # Bytes under which a restore teaches ``read_rate`` nothing: its fixed
    # costs (a lookup, a first restore's threads and kernels: 0.15 s for 1
    # MB on an H200) would make a 1 GB one look a hundred times slower.
    read_min_bytes = 64 << 20

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
        # [bytes, seconds] restored, older ones weighing half; the rates known
        self._rates = self._known_rates()
        self._read, self._rates_kept = list(self._rates["read"]), -self.rates_every
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
        """Bytes a second restores of ``read_min_bytes`` or more took, the
        recent ones weighing most; ``read_prior`` until one is measured."""
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
                    h.update(_file_digest(path))
                self._digests[key] = "sha256:" + h.hexdigest()[:32]
                self._keep_digests()
        return self._digests[key]

    # The digests read, by the files' stats: a restart does not read the
    # weights again (16 GB for an 8B model) while their stats are the same.
    digests_file = ".model-digests.json"

    # What restores and prefills took here ([bytes, seconds] read, [tokens,
    # seconds] prefilled): a restart's cost model starts from what was
    # measured, not from ``read_prior`` and no prefill rate. Written by the
    # writer thread at most every ``rates_every`` seconds, and at ``close``.
    rates_file = ".rates.json"
    rates_every = 10.0

    def _known_digests(self) -> dict:
        """The digests ``digests_file`` holds ({} if it holds none)."""
        known = self._read_json(self.digests_file)
        ok = isinstance(known, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in known.items()
        )
        return known if ok else {}

    def _keep_digests(self):
        self._write_json(self.digests_file, self._digests)

    def _known_rates(self) -> dict:
        """``{"read": [bytes, seconds], "prefill": [tokens, seconds]}`` as
        ``rates_file`` holds them (zeros where it holds none)."""
        known, rates = self._read_json(self.rates_file), {}
        for k in ("read", "prefill"):
            v = known.get(k) if isinstance(known, dict) else None
            ok = isinstance(v, list) and len(v) == 2
            ok = ok and all(type(x) in (int, float) and 0 < x < 1e30 for x in v)
            rates[k] = [v[0], v[1]] if ok else [0, 0.0]
        return rates

    def _keep_rates(self, prefill: list):
        """Note the prefill rate to keep (``_save_rates`` writes it)."""
        self._rates["prefill"] = list(prefill)

    def _save_rates(self, now: bool = False):
        """Write ``_read`` and the prefill noted to ``rates_file`` if any was
        measured, unless they were written less than ``rates_every`` seconds
        ago (``now``: at once). The writer thread calls it, and ``close``."""
        measured = self._read[1] or self._rates["prefill"][1]
        if measured and (
            now or time.monotonic() - self._rates_kept >= self.rates_every
        ):
            self._rates_kept = time.monotonic()
            self._rates["read"] = list(self._read)
            self._write_json(self.rates_file, self._rates)

    def _read_json(self, name: str):
        """What the JSON file ``name`` holds (``None`` if it is not a regular
        file of at most 1 MB of JSON)."""
        path = os.path.join(self.directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    return None
                return json.loads(f.read(1 << 20))
        except (OSError, ValueError):
            return None

    def _write_json(self, name: str, value):
        """Write ``value`` to the JSON file ``name`` (best effort, warned),
        room made for it first: the budget counts it (``_shrink``)."""
        path = os.path.join(self.directory, name)
        temp, data = f"{path}.{os.getpid()}-{id(self):x}", json.dumps(value)
        self._lock_dir()
        try:
            self._shrink(room=2 * len(data))  # the file and its replacement
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
            with os.fdopen(os.open(temp, flags, self.mode), "w") as f:
                f.write(data)
            os.replace(temp, path)
        except OSError as e:
            logging.warning(f"[prompt cache] could not write {path}: {e!r}")
            if os.path.lexists(temp):
                os.remove(temp)
        finally:
            self._unlock_dir()

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
                if e.name.startswith((self.digests_file, self.rates_file)):
                    continue  # what is known (and being written)
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
