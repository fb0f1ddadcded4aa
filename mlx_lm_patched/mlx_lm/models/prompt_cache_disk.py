"""A disk tier for prompt caches: entries written behind by a thread,
bit-exact, bounded, found again after a restart (``DiskPromptCache``), and
an ``LRUPromptCache`` that spills to it and reads back (``DiskLRUPromptCache``)."""

import json
import logging
import os
import queue
import stat
import threading
import time
from typing import Any, List, Optional

import mlx.core as mx

from .cache import (
    LRUPromptCache,
    PromptBlocks,
    _back_to,
    _prompt_cache_from_arrays,
    can_trim_prompt_cache,
    prompt_cache_layout,
    prompt_cache_mismatch,
    prompt_cache_state,
)
from .prompt_cache_disk_blocks import PromptBlockDir, _own_copies, _to_host
from .prompt_cache_entries import _disk_restore_point, _ring_points
from .prompt_cache_host import _state_nbytes


class DiskPromptCache(PromptBlockDir):
    """Prompt caches in ``directory``, at most ``max_bytes`` of files.

    Each file is a ``.safetensors`` prompt cache named by a hash of its model
    key and tokens; its metadata holds both, the tokens it can trim, a
    checksum of its whole header (``_manifest``) and a CRC-32 of its data.
    ``put`` queues the entry (and the device copies the writer reads:
    ``_own_copies``) and returns; the queue holds at most ``queue_bytes``
    of them: ``flush`` waits for the writes, ``close`` ends the writer.
    Several processes may share ``directory``: the budget is counted over
    its files under an ``flock`` of the directory, the least recently used
    (oldest mtime) go first. ``DiskLRUPromptCache`` writes its entries'
    prefixes as block files of ``block_tokens`` tokens, shared by entries.
    """

    # Seconds a stopping server gives the writer to write what is queued.
    drain_seconds = 10.0

    def __init__(
        self,
        directory: str,
        max_bytes: int = 1 << 63,
        queue_bytes: int = 1 << 30,
        mode: int = 0o600,
        digest_wait: bool = True,
        block_tokens: int = 1024,
    ):
        if not isinstance(queue_bytes, int) or queue_bytes < 0:
            raise ValueError(f"queue_bytes must be >= 0, got {queue_bytes!r}")
        if not isinstance(block_tokens, int) or block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens!r}")
        # name -> (file bytes, where its rings all have checkpoints)
        self._points = {}
        PromptBlockDir.__init__(self, directory, max_bytes, mode)
        self.queue_bytes = queue_bytes
        # Whether put and get wait for a model directory's digest (the
        # server's do not: they miss until a thread has read it).
        self.digest_wait = digest_wait
        # Tokens a block file of DiskLRUPromptCache's entries holds: fewer,
        # larger files restore faster (a file's header and checks cost ~2 ms
        # of the GIL), smaller ones share more of a prefix on disk.
        self.block_tokens = block_tokens
        self.queued_bytes = 0  # of the entries in _pending
        # Entries put and not written: no room in the queue or in the budget,
        # or an error writing them (warned); and entries written.
        self.dropped = self.written = 0
        self.last_read = None  # (bytes, seconds) of the last restore: get
        self._layouts = {}  # model key -> prompt_cache_layout of its own caches
        self._closed = self._given_up = False  # close(); its timeout ran out
        self._queue = queue.Queue()  # (name, state, bytes) of _pending, then None
        self._host_stream = None  # the writer's CPU stream (_to_host)
        self._writer = threading.Thread(target=self._write_loop, daemon=True)
        self._writer.start()

    @property
    def queued(self):
        """Entries queued, not yet written."""
        return len(self._pending)

    def tally(self):
        """``(queued, written, dropped)`` read at one instant: the writer
        moves an entry from the first to the second under the same lock."""
        with self._lock:
            return len(self._pending), self.written, self.dropped

    def put(self, model: Any, tokens: List[int], cache: List[Any]):
        """Queue ``cache``, the cache of ``tokens``, to be written, and return
        (its arrays scheduled here, copied for the writer, never waited
        for on the calling thread); ``get`` serves it from now on. An entry
        written or queued already is left as it is; one that would take the
        queue past ``queue_bytes`` (unless the queue is empty) or is larger
        than ``max_bytes`` is dropped (warned, counted in ``dropped``)."""
        if self._closed:
            raise ValueError("DiskPromptCache.put after close()")
        tokens = [int(t) for t in tokens]
        model = self._model_key(model, self.digest_wait)
        if model is None:  # the weights' digest is being read: not written
            return
        name = self._name(model, tokens)
        if name in self._files or name in self._pending:
            return
        # The most tokens trim_prompt_cache can take off exactly (a wrapped
        # ring: its slack); can_trim_prompt_cache is monotone in the count.
        trimmable, hi = 0, len(tokens)
        while trimmable < hi:
            mid = (trimmable + hi + 1) // 2
            trimmable, hi = (
                (mid, hi) if can_trim_prompt_cache(cache, mid) else (trimmable, mid - 1)
            )
        cache, blocks_metadata, blocks = self._blocked(model, tokens, cache)
        self._learn(model, cache)
        # An entry a queue already holding others cannot take is dropped
        # before its state is made (a view and a schedule an array: 20-40 ms
        # of a Gemma-3 entry's 2,700 arrays on an H200's host).
        if self._pending:
            least = _state_nbytes(cache)
            with self._lock:
                if self._dropped(tokens, least):
                    return
        metadata = {
            "model": model,
            "tokens": json.dumps(tokens),
            "trimmable": str(trimmable),
            **blocks_metadata,
        }
        state = prompt_cache_state(cache, metadata)
        state.blocks, state.entry = blocks, (model, tokens, trimmable)
        with self._lock:
            if name in self._pending or self._dropped(tokens, state.nbytes):
                return
            self._pending[name] = state
            self.queued_bytes += state.nbytes
            self._add(name, (model, tokens, trimmable, 0))  # 0: no file yet
        self._queue.put((name, state, _own_copies(state), state.nbytes))

    def _dropped(self, tokens: List[int], nbytes: int, held: int = 0) -> bool:
        """Whether an entry of ``nbytes`` is dropped (warned, counted): larger
        than ``max_bytes``, or past ``queue_bytes`` with the queue (and the
        ``held`` bytes waiting to be put) not empty. Called with ``_lock``
        held."""
        why, queued = None, self.queued_bytes + held
        if nbytes > self.max_bytes:
            why = f"--prompt-cache-disk-bytes {self.max_bytes}"
        elif (self._pending or held) and queued + nbytes > self.queue_bytes:
            why = f"{queued} B queued, --prompt-cache-queue-bytes {self.queue_bytes}"
        if why is not None:
            self.dropped += 1
            logging.warning(
                f"[prompt cache] not writing {len(tokens)} tokens "
                f"({nbytes} B): {why}; {self.dropped} dropped so far"
            )
        return why is not None

    def learn(self, model: Any, cache: List[Any]):
        """Take ``cache`` as what ``model``'s caches look like: an entry of
        ``model`` with other layers or head dims is a miss."""
        key = self._model_key(model, self.digest_wait)
        if key is not None:
            self._learn(key, cache)

    def _learn(self, key: str, cache: List[Any]):
        if key not in self._layouts:
            try:
                self._layouts[key] = prompt_cache_layout(cache)
            except Exception:
                pass  # a cache kind it cannot describe: nothing to compare

    def _write_loop(self):
        """Write what is queued, until ``None``. An entry not written (no
        room, an error: warned once, naming it) is counted in ``dropped``
        and not served; the loop goes on whatever happens."""
        while (item := self._queue.get()) is not None:
            name, state, own, nbytes = item
            done = False
            try:
                done = not self._given_up and self._write(name, own)
            except Exception as e:
                logging.warning(f"[prompt cache] could not write {name}: {e!r}")
            try:
                with self._lock:
                    if self._pending.get(name) is state:
                        del self._pending[name]
                        if not done and name in self._files:
                            self._drop(name)  # not written: not served
                    self.queued_bytes -= nbytes
                    if done:
                        self.written += 1
                    else:
                        self.dropped += 1
                    left = len(self._pending)
                # What is still queued: a kill -9 loses it
                wrote = "wrote" if done else "did not write"
                logging.info(
                    f"Prompt cache: {wrote} an entry ({nbytes} B), {left} queued"
                )
            except Exception as e:
                logging.warning(f"[prompt cache] after writing {name}: {e!r}")
            finally:
                self._queue.task_done()
            self._save_rates()
        self._save_rates(now=True)
        self._queue.task_done()

    def _write(self, name: str, state):
        """Write the queued entry ``name`` (its block files first) with the
        directory locked, having made room for its files first (so its
        files never take the directory past ``max_bytes``, replicas' writes
        included); whether it was written."""
        # The host copy, on this thread: the arrays' own memory, read in place.
        if self._host_stream is None:  # streams are the thread's own
            self._host_stream = mx.new_stream(mx.cpu)
        _to_host(state, self._host_stream)
        host = self._seal(state)[0]
        path = os.path.join(self.directory, name)
        self._lock_dir()
        try:
            self._present(name)  # anything but a file there is set aside
            new = {
                b: self._seal(s.host())[0]
                for b, s in state.blocks.items()
                if not self._present(b)
            }
            need = sum(self._file_bytes(h) for h in (host, *new.values()))
            keep = set(state.blocks)
            if need <= self.max_bytes:
                self._shrink(room=need, keep=keep)
            if self._n_bytes + need > self.max_bytes:
                logging.warning(
                    f"[prompt cache] not writing {name} ({need} B): "
                    f"{self._n_bytes} B in {self.directory}, "
                    f"--prompt-cache-disk-bytes {self.max_bytes}"
                )
                return False
            temps = {}
            try:
                for b, h in (*new.items(), (name, host)):
                    temps[b] = self._save_temp(b, h, need, keep)
                for b in temps:  # the blocks before the entry naming them
                    os.replace(temps[b][0], os.path.join(self.directory, b))
            finally:
                self._close_temps(temps)
            now = time.time_ns()  # finer than the file system's clock
            os.utime(path, ns=(now, now))
            size = os.path.getsize(path)
            with self._lock:
                self._add(name, (*state.entry, size))
                self._points[name] = (size, _ring_points(state.metadata))
            self._shrink()
        finally:
            self._unlock_dir()
        return True

    def _drop(self, name: str):
        PromptBlockDir._drop(self, name)
        self._points.pop(name, None)

    def _pending_cache(self, name: str):
        """The cache of the queued entry ``name``, sharing its arrays, or
        ``None`` once it is written."""
        state = self._pending.get(name)
        if state is None:
            return None
        found = {}  # key -> its blocks' arrays, in order
        for block in state.blocks.values():
            for k, x in self._views(block.host()).items():
                found.setdefault(k, []).append(x)
        arrays = self._join(self._views(state), state.metadata, found)
        return _prompt_cache_from_arrays(arrays, state.metadata, name)[0]

    def _load(self, name: str):
        """The cache in file ``name``, or ``None`` (warned) if it is not sound:
        its header must be the one indexed and pass every check, its data
        its CRC, each layer hold the tokens its header names. Its arrays
        are read in parallel (``_read_arrays``) and each is copied into MLX
        while the next are read; the time taken goes into ``read_rate``."""
        path, st = os.path.join(self.directory, name), None
        start = time.perf_counter()
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError("not a regular file")
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            try:  # header and data from one open file: a rename cannot mix them
                entry, header = self._read_header(path, full=True, fd=fd)
                if entry != self._files.get(name):
                    raise ValueError("it changed since it was indexed")
                arrays = {}

                def build(k, data):  # to the device while more is read
                    arrays[k] = self._array(header[k], data)
                    mx.async_eval(arrays[k])

                self._read_arrays(fd, header, build)
            finally:
                os.close(fd)
            metadata = header["__metadata__"]
            arrays = self._with_blocks(entry, header, arrays)  # shared prefix
            mx.eval(list(arrays.values()))
            cache = _prompt_cache_from_arrays(arrays, metadata, path, finite=True)[0]
            for i, c in enumerate(cache):
                offset = getattr(c, "offset", None)
                if isinstance(offset, int) and offset != len(entry[1]):
                    raise ValueError(
                        f"layer {i} holds {offset} tokens, its header {len(entry[1])}"
                    )
            read = self._restore_bytes(entry[3], self._named_blocks(header))
            self.last_read = (read, time.perf_counter() - start)
            if read >= self.read_min_bytes:
                self._observe(self._read, *self.last_read)
            return cache
        except Exception as e:
            logging.warning(f"[prompt cache] skipping {path}: {e!r}")
            if st is not None and (
                not stat.S_ISREG(st.st_mode)
                or isinstance(e, OSError)
                and e.errno in self.unreadable
            ):  # set aside: the next write puts the entry there
                self._remove_unsound(name, st)
            return None

    def get(self, model: Any, tokens: List[int], cached: int = 0, saves=None):
        """``(cache, tokens left to prefill)`` from the entry that reuses the
        most of ``tokens`` for ``model``, if it reuses more than ``cached``;
        else ``None``. With ``saves(n, bytes read)``, the seconds restoring
        an entry (its file and block files) that reuses ``n`` tokens saves,
        the entry that saves the most (a shorter one, or a longer one
        trimmed back), if one saves any; ``None`` while the weights' digest
        is being read."""
        model = self._model_key(model, self.digest_wait)
        self.last_read = None
        if model is None:
            return None
        while True:
            with self._lock:
                options = self._options(model, tokens, cached)
                if saves is None:
                    options = [(n, n, s) for n, s in options]
                else:
                    options = [
                        (saves(n, self._entry_bytes(self._name(model, s))), n, s)
                        for n, s in options
                    ]
                    options = [x for x in options if x[0] > 0]
                if not options:
                    return None
                _, n, stored = max(options, key=lambda x: x[:2])
                name = self._name(model, stored)
            cache = self._pending_cache(name) or self._load(name)
            expected = self._layouts.get(model)
            if cache is not None and expected is not None:
                why = prompt_cache_mismatch(expected, cache)
                if why is not None:
                    logging.warning(f"[prompt cache] skipping {name}: {why}")
                    cache = None
            if cache is not None and len(stored) > n:  # trimmed, or checkpoints
                cache = _back_to(cache, len(stored), n)
                if cache is None:
                    logging.warning(f"[prompt cache] skipping {name}: cannot trim")
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

    def probe_read(self):
        """Restore the smallest entry of ``read_min_bytes`` or more once, and
        drop it, if no restore was measured here yet: a restarted server's
        first hit is then chosen by what a read takes on this machine, not
        by ``read_prior`` (an H200 read 64-token block files at 1.2 GB/s,
        and restored an entry slower than its prefill). ``True`` if it
        measured one."""
        if self._read[1]:
            return False
        with self._lock:
            sizes = [(self._entry_bytes(name), name) for name in self._files]
        sizes = sorted(x for x in sizes if x[0] >= self.read_min_bytes)
        return bool(sizes) and self._load(sizes[0][1]) is not None

    def _options(self, model: str, tokens: List[int], cached: int = 0):
        """``(tokens reused, stored tokens)`` of each entry that can serve
        ``tokens`` reusing more than ``cached``: every stored prefix of them,
        and the shortest longer entry trimmed back to their common prefix,
        where it can be trimmed (``LRUPromptCache.fetch_nearest_cache``'s
        candidates; its header is read only if it could reuse more). Called
        with the lock held."""
        options, node = [], self._trie._trie.get(model, {})
        for i in range(len(tokens) + 1):
            if "__value__" in node and i > cached:
                options.append((i, tokens[:i]))
            if i == len(tokens) or tokens[i] not in node:
                break
            node = node[tokens[i]]
        result = self._trie.search(model, tokens)
        prefix = min(len(tokens) - 1, result.common_prefix)
        longer = result.longer
        if longer is not None and result.exact is None and prefix > cached:
            n = _disk_restore_point(self, model, longer, prefix)
            options += [(n, longer)] if n > cached else []
        return options

    def flush(self):
        """Wait until every queued cache is written."""
        self._queue.join()

    def close(self, timeout: Optional[float] = None):
        """Write what is queued and end the writer thread; with ``timeout``,
        give up after that many seconds: what is left is not written (warned).
        Returns the number of entries left."""
        if self._closed:
            return 0
        self._closed = True
        self._queue.put(None)
        self._writer.join(timeout)
        if self._writer.is_alive():  # it skips the rest, ends the file it writes
            self._given_up = True
            left = len(self._pending)
            logging.warning(
                f"[prompt cache] {left} entries ({self.queued_bytes} B) not "
                f"written to {self.directory}: the {timeout} s to write them ran out"
            )
            return left
        os.close(self._dir_fd)
        return len(self._pending)


class DiskLRUPromptCache(LRUPromptCache):
    """An ``LRUPromptCache`` that writes what it stores to ``disk`` (a
    ``DiskPromptCache``) and reads from it where memory has less. With
    ``bits``, files hold the entries as quantized at rest, dequantized on
    fetch.

    It restores only what is expected to be faster than recomputing: an
    entry of ``b`` bytes that reuses ``n`` tokens where memory reuses
    ``m`` is read only if ``b / disk.read_rate < (n - m) / prefill_rate``
    (reading it takes less than prefilling what it saves), and of several
    the one that saves the most (a shorter one, or a longer one trimmed
    back). ``disk.read_rate`` is measured by every restore of
    ``read_min_bytes`` or more, from the lookup to the working cache (all
    that the request waits for); ``prefill_rate``
    (tokens a second) by ``observe_prefill`` or, read when a prompt is
    fetched, ``prefill_counters`` (an object counting ``prompt_tokens`` and
    ``prompt_time``: a ``BatchGenerator``'s, which the server sets). Both
    are kept in the directory (``rates_file``): a restarted server starts
    from them, and one that never measured a read measures one at its
    warm-up (``DiskPromptCache.probe_read``). Until a prefill is measured,
    the entry reusing the most is restored.
    """

    # Tokens under which a prefill teaches ``prefill_rate`` nothing: its
    # fixed costs (a request's, a new shape's kernels) would make a long
    # prompt look slower to prefill than it is, and its entry be restored.
    prefill_min_tokens = 256

    # False: an inserted entry, and an evicted one (within the queue's
    # bytes), is queued for the disk by ``spill_idle``, not at once. A put
    # makes the entry's state on the calling thread (30-60 ms of a Gemma-3
    # entry on an H200's host): the server's next request, sent as the last
    # one ended, waited for it.
    spill_at_once = True

    # Tokens a held evicted entry must reuse past memory's for a request to
    # queue it (its put is made then, on the serving thread): a request
    # behind a shared system prompt shares a few more with each other's.
    held_min_tokens = 128

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
        self._unspilled = {}  # (model, tokens) inserted, not queued: in order
        self._evicted = []  # (model, tokens, entry) evicted, not queued
        self.prefill_counters = None
        self._counted = (None, 0, 0.0)  # counters, tokens and seconds seen
        # [tokens, seconds], each older weighing half; from the directory's
        self._prefill = list(disk._rates["prefill"])

    @property
    def prefill_rate(self):
        """Tokens a second prefills took, the recent ones weighing most;
        ``None`` before one is measured."""
        self._count_prefills()
        return self._prefill[0] / self._prefill[1] if self._prefill[1] else None

    def _count_prefills(self):
        """Fold what ``prefill_counters`` counted since the last look into
        the rate (and the rates the directory keeps)."""
        counters = self.prefill_counters
        if counters is not None:
            seen, tokens, seconds = self._counted
            now = (counters, counters.prompt_tokens, counters.prompt_time)
            if seen is not counters:
                tokens, seconds = 0, 0.0
            self._counted = now
            if now[2] > seconds:
                self.observe_prefill(now[1] - tokens, now[2] - seconds)

    def observe_prefill(self, tokens: int, seconds: float):
        """Count ``tokens`` prefilled in ``seconds``, if at least
        ``prefill_min_tokens``."""
        if tokens >= self.prefill_min_tokens and seconds > 0:
            self.disk._observe(self._prefill, tokens, seconds)
            self.disk._keep_rates(self._prefill)

    def fetch_nearest_cache(self, model: Any, tokens: List[int]):
        cache, rest = LRUPromptCache.fetch_nearest_cache(self, model, tokens)
        tier = "miss" if cache is None else "memory hit"
        start = None
        if len(rest) > 1:  # the last token is prefilled whatever the disk has
            cached = len(tokens) - len(rest)
            rate, read = self.prefill_rate, self.disk.read_rate
            saves = (
                None if rate is None else lambda n, b: (n - cached) / rate - b / read
            )
            start = time.perf_counter()
            try:
                self._spill_held(model, tokens, cached)
                self.disk._refresh()  # what replicas wrote
                found = self.disk.get(model, tokens, cached, saves)
            except Exception as e:  # a miss, never the generation thread's end
                logging.warning(f"[prompt cache] disk tier failed: {e!r}")
                found = None
            if found is not None:
                # Kept in memory too: a repeat is a memory hit.
                n = len(tokens) - len(found[1])
                LRUPromptCache.insert_cache(self, model, tokens[:n], found[0])
                cache, rest, tier = self._working(found[0]), found[1], "disk hit"
        n = len(tokens) - len(rest)
        had = ""
        if tier == "disk hit":
            took, read = time.perf_counter() - start, self.disk.last_read
            if read is not None and read[0] >= self.disk.read_min_bytes:
                self.disk._read[1] += max(0.0, took - read[1])  # all it waited
            read = "queued" if read is None else f"read {read[0]} B in {read[1]:.2f} s"
            had = f" (memory had {cached}; {read} of {took:.2f} s)"
        elif start is not None:  # what asking the disk tier cost
            had = f" (disk tier asked in {time.perf_counter() - start:.3f} s)"
        logging.info(f"Prompt cache {tier}: {n} of {len(tokens)} tokens{had}")
        return cache, rest

    def insert_cache(self, model: Any, tokens: List[int], prompt_cache, **kwargs):
        # The prefill that made it counts now, not at a next request that a
        # stop may never see (a restart then knew no rate, restored anything)
        self._count_prefills()
        # What the disk tier serves this model must look like its own caches.
        try:
            self.disk.learn(model, prompt_cache)
        except Exception as e:  # never the generation thread's end
            logging.warning(f"[prompt cache] disk tier failed: {e!r}")
        LRUPromptCache.insert_cache(self, model, tokens, prompt_cache, **kwargs)
        try:  # written behind: queued now (evicted at once, _evict queued it)
            entry = self._trie.get(model, tokens)
        except KeyError:
            return
        if self.spill_at_once:
            self._spill(model, tokens, entry)
        else:  # the key only: an entry memory drops meanwhile is freed
            key = (model, tuple(tokens))
            self._unspilled.pop(key, None)
            self._unspilled[key] = None

    def spill_idle(self):
        """Queue the entries evicted since the last call, then those
        inserted that memory still holds, newest first (a fetch copies an
        entry: it is as stored)."""
        evicted, self._evicted = self._evicted, []
        for model, tokens, entry in evicted:
            self._spill(model, tokens, entry)
        while self._unspilled:
            (model, key), _ = self._unspilled.popitem()
            tokens = list(key)
            try:
                entry = self._trie.get(model, tokens)
            except KeyError:  # evicted (queued then) or dropped
                continue
            self._spill(model, tokens, entry)

    def _evict(self):
        model, tokens, entry = LRUPromptCache._evict(self)
        if self.spill_at_once:
            self._spill(model, tokens, entry)  # nothing if it is on disk already
        else:
            self._hold_evicted(model, tokens, entry)
        return model, tokens, entry

    def _spill_held(self, model: Any, tokens: List[int], cached: int):
        # An evicted entry held for spill_idle that reuses held_min_tokens
        # more of tokens than memory does: queued now, where get finds it
        held, self._evicted = self._evicted, []
        stop = cached + self.held_min_tokens  # the last token is computed
        for m, t, entry in held:
            if m == model and stop < len(tokens) and t[:stop] == tokens[:stop]:
                self._spill(m, t, entry)
            else:
                self._evicted.append((m, t, entry))

    def _hold_evicted(self, model: Any, tokens: List[int], entry):
        # Kept for spill_idle, not put on the serving thread (the put of a
        # Gemma-3 entry took 30-60 ms of the request that evicted it), within
        # the queue's bytes: it holds no more than its put's copies would.
        disk = self.disk
        key = disk._model_key(model, disk.digest_wait)
        if key is None or disk._name(key, tokens) in disk._files:
            return  # not written while the weights' digest is read; on disk
        held = sum(e.nbytes for *_, e in self._evicted)
        with disk._lock:
            if not disk._dropped(tokens, entry.nbytes, held):
                self._evicted.append((model, tokens, entry))

    def _spill(self, model: Any, tokens: List[int], entry):
        # The entry as it rests (quantized with bits), cut into block files
        # of disk.block_tokens whatever memory's blocks: views of it, memory
        # keeps it as it is (whole until _settle: the next request takes it so)
        size = self.disk.block_tokens
        try:
            layers = self._quantized(self._blocks.assemble(entry.prompt_cache))
            layers = PromptBlocks(size).share(model, tokens, layers, views=True)
            self.disk.put(model, tokens, layers)
        except Exception as e:  # not written: a miss later, never an error now
            logging.warning(f"[prompt cache] disk tier failed: {e!r}")
