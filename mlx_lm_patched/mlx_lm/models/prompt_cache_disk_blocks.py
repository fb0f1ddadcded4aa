"""Block files: the prefix blocks prompt-cache entries share, on disk once
(``PromptBlockDir``, the ``PromptCacheDir`` the disk tier stands on)."""

import copy
import errno
import fcntl
import hashlib
import json
import logging
import math
import os
import stat
import zlib
from typing import Any, Dict, List

import mlx.core as mx
from mlx.utils import tree_flatten

from .cache import HostPromptCache, PromptBlocks, SharedPrefixCache
from .prompt_cache_dir import PromptCacheDir


class _Columns:
    """Columns ``start:stop`` (the token axis) of an evaluated ``array``: a
    block of a run (``PromptBlocks``), sliced where it is read (on the
    writer thread, in numpy) rather than one MLX view a block and layer."""

    def __init__(self, array, start: int, stop: int, shape: tuple, dtype):
        self.array, self.start, self.stop, self.dtype = array, start, stop, dtype
        self.shape = (*shape[:2], stop - start, *shape[3:])
        self.nbytes = dtype.size
        for n in self.shape:
            self.nbytes *= n

    def __array__(self, dtype=None, copy=None):
        import numpy as np

        return np.asarray(self.array)[..., self.start : self.stop, :]

    def view(self, dtype):
        return self.array.view(dtype)[..., self.start : self.stop, :]


class _Block:
    """A queued block file: its ``HostPromptCache`` is built where it is read
    (the writer thread, which writes only the blocks not on disk yet; a
    fetch of a queued entry), not one per block and layer at ``put``."""

    def __init__(self, shared: dict, runs: dict, held: list, j: int, meta: dict):
        self.shared, self.runs, self.held, self.j, self.meta = (
            shared,
            runs,
            held,
            j,
            meta,
        )

    @property
    def nbytes(self):
        return sum(self.shared[i][0].blocks[self.j][2] for i, _ in self.held)

    def host(self):
        arrays, dtypes = {}, {}
        for i, _ in self.held:
            run, _, _, _, start, stop = self.shared[i][0].blocks[self.j]
            for k, dtype_name, shape, x in self.runs[i, id(run)]:
                dtypes[k] = dtype_name
                arrays[k] = _Columns(x, start, stop, shape, x.dtype)
        return HostPromptCache(arrays, dtypes, self.meta)


class _Packed:
    """An array the writer reads: ``shape`` of ``dtype`` copied into byte
    buffer ``blobs[i]`` from byte ``start`` (``_own_copies``)."""

    def __init__(self, blobs: list, i: int, start: int, shape: tuple, dtype):
        self.blobs, self.i, self.start = blobs, i, start
        self.shape, self.dtype = shape, dtype
        self.nbytes = dtype.size * math.prod(shape)

    def __array__(self, dtype=None, copy=None):
        import numpy as np

        data = np.asarray(self.blobs[self.i])[self.start : self.start + self.nbytes]
        return data.view(str(self.dtype).rpartition(".")[2]).reshape(self.shape)


def _own_copies(state, blob_bytes: int = 64 << 20):
    """``state`` as the writer thread reads it: its arrays and its blocks'
    runs (the scalars and strings made for the file, 0 or 1-d, are their
    own) copied on the device into byte buffers of about ``blob_bytes``
    (``_Packed``), scheduled, never waited for here. On CUDA a host read
    moves an MLX array's buffer off the device and frees it, under the
    kernels of the requests that still use it: the server died (``illegal
    memory access``) with the same 24k-token prompt twice and the disk tier
    on. The writer brings the buffers to host (``_to_host``)."""
    runs = {id(b.runs): b.runs for b in state.blocks.values()}
    arrays = [*state.arrays.values()]
    arrays += [x[-1] for r in runs.values() for xs in r.values() for x in xs]
    packed, blobs, group, size = {}, [], [], 0

    def pack():
        flat = [x.reshape(-1).view(mx.uint8) for x in group]
        blobs.append(mx.concatenate(flat) if len(flat) > 1 else flat[0] * 1)
        start = 0
        for x in group:
            packed[id(x)] = _Packed(blobs, len(blobs) - 1, start, x.shape, x.dtype)
            start += x.nbytes

    for x in arrays:
        if getattr(x, "ndim", 0) < 2 or id(x) in packed:
            continue
        if group and size + x.nbytes > blob_bytes:
            pack()
            group, size = [], 0
        group.append(x)
        size += x.nbytes
        packed[id(x)] = None
    if group:
        pack()
    own = lambda x: packed.get(id(x)) or x  # noqa: E731
    own_state = copy.copy(state)
    own_state.arrays = {k: own(x) for k, x in state.arrays.items()}
    own_runs = {
        n: {key: [(*spec, own(x)) for *spec, x in xs] for key, xs in r.items()}
        for n, r in runs.items()
    }
    own_state.blocks = {
        name: _Block(b.shared, own_runs[id(b.runs)], b.held, b.j, b.meta)
        for name, b in state.blocks.items()
    }
    own_state.blobs = blobs
    mx.async_eval(blobs)
    return own_state


def _to_host(state, stream):
    """Bring ``state``'s buffers (``_own_copies``) to host in one evaluation
    on the CPU ``stream``: the GIL is free while a buffer leaves the device,
    where ``np.asarray`` would hold it (on CUDA a Gemma-3 entry's copies to
    host stalled the serving thread for up to 0.2 s each), and what the CPU
    then reads is in host memory already."""
    state.blobs[:] = [mx.add(b, 0, stream=stream) for b in state.blobs]
    mx.eval(state.blobs)


class PromptBlockDir(PromptCacheDir):
    """A ``PromptCacheDir`` whose entries may name shared block files."""

    def __init__(self, directory: str, max_bytes: int = 1 << 63, mode: int = 0o600):
        self._refs_seen = {}  # entry name -> ((inode, ctime), the block files it names)
        self._blocks_pool = (0, None)  # (read_threads, threads reading block files)
        PromptCacheDir.__init__(self, directory, max_bytes, mode)

    @staticmethod
    def _shared_keys(keys, layers) -> Dict[str, List[str]]:
        """Per layer of ``layers`` (indices as strings), the suffixes of its
        keys and values among the array ``keys`` ("0", "0.1", "1", ...)."""
        out = {}
        for k in keys:
            i, _, suffix = k.partition(".")
            if i in layers and suffix.split(".")[0] in ("0", "1"):
                out.setdefault(i, []).append(suffix)
        return out

    @staticmethod
    def _layout(name: str, arrays: Dict[str, tuple]):
        """A layer's layout: its class ``name`` and, per array key suffix, its
        dtype and shape past the token axis (``arrays``: suffix -> (dtype,
        shape))."""
        return [name, [[k, d, s[:2] + s[3:]] for k, (d, s) in sorted(arrays.items())]]

    def _block_names(self, model: str, tokens: List[int], size: int, layers: dict):
        """The block files of an entry of ``model`` and ``tokens``: per block,
        ``(name, its layers' layouts, chain digest)``; ``layers``: layer
        index -> (block count, layout)."""
        out, held, prefix = [], None, ""
        for j, digest in enumerate(PromptBlocks(size).chain(model, tokens)):
            now = [[i, lay] for i, (n, lay) in sorted(layers.items()) if n > j]
            if not now:
                break
            if now != held:  # one list (and its JSON) while the layers held agree
                held, prefix = now, json.dumps([model, now])[:-1]
            key = f'{prefix}, "{digest.hex()}"]'.encode()  # json.dumps of the three
            name = hashlib.sha256(key).hexdigest()[:32] + ".block.safetensors"
            out.append((name, held, digest.hex()))
        return out

    def _blocked(self, model: str, tokens: List[int], cache: List[Any]):
        """``(layers, metadata, blocks)``: ``cache`` as its entry file holds
        it (each ``SharedPrefixCache`` layer its tail), the ``blocks``
        metadata naming its block files ({} if none), and each block file's
        ``_Block`` (its MLX arrays, not copied)."""
        layers, shared, blocks = list(cache), {}, {}
        for i, c in enumerate(cache):
            if isinstance(c, SharedPrefixCache):
                layers[i] = copy.copy(c.template)
                layers[i].keys, layers[i].values = c.tail
                flat = tree_flatten(c.tail)
                arrays = {k: (str(x.dtype).split(".")[-1], x.shape) for k, x in flat}
                shared[i] = (c, self._layout(type(layers[i]).__name__, arrays))
        if not shared:
            return cache, {}, {}
        size = {(c.offset - tree_flatten(c.tail)[0][1].shape[2]) // len(c.blocks)
                for c, _ in shared.values()}  # fmt: skip
        if len(size) != 1:
            raise ValueError(f"layers cut into blocks of sizes {sorted(size)}")
        size = size.pop()
        counts = {i: (len(c.blocks), lay) for i, (c, lay) in shared.items()}
        names = self._block_names(model, tokens, size, counts)
        runs = {}  # (layer, run) -> its arrays viewed as stored, evaluated once
        for i, (c, _) in shared.items():
            for run in {id(b[0]): b[0] for b in c.blocks}.values():
                runs[i, id(run)] = [
                    (f"{i}.{k}", str(x.dtype).split(".")[-1], x.shape)
                    + ((x.view(mx.uint16),) if x.dtype == mx.bfloat16 else (x,))
                    for k, x in tree_flatten(run[0])
                ]
        mx.async_eval([[x[-1] for x in run] for run in runs.values()])  # views
        texts = {}  # id of a held list -> its JSON
        for j, (name, held, digest) in enumerate(names):
            if id(held) not in texts:
                texts[id(held)] = json.dumps(held)
            meta = {"0.model": model, "0.layers": texts[id(held)], "0.chain": digest}
            blocks[name] = _Block(shared, runs, held, j, meta)
        meta = {"size": size, "layers": {str(i): n for i, (n, _) in counts.items()}}
        meta["files"] = [name for name, _, _ in names]
        return layers, {"format": "2", "blocks": json.dumps(meta)}, blocks

    def _save_temp(self, name: str, host, free: int, keep=()):
        """``(temp, fd)``: ``host`` saved to a new temporary file beside file
        ``name``, locked while open (so no scan takes it for stale); on a
        full disk the oldest entries make room for ``free`` bytes (``keep``:
        the block files the entry written names). Called with the directory
        locked."""
        temp = os.path.join(self.directory, f"{name}.{os.getpid()}-{id(self):x}.tmp")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
        fd = os.open(temp, flags, self.mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            while True:
                try:
                    host.save(temp)
                    break
                except OSError as e:
                    full = e.errno in (errno.ENOSPC, errno.EDQUOT)
                    if not (full and self._shrink(free=free, keep=keep)):
                        raise
        except BaseException:
            os.remove(temp)
            os.close(fd)
            raise
        return temp, fd

    @staticmethod
    def _file_bytes(host):
        """The bytes of the file ``host.save`` writes."""
        n = len(json.dumps(host.header()).encode())
        return 8 + n + (-n % 8) + host.nbytes

    @staticmethod
    def _close_temps(temps: dict):
        for temp, fd in temps.values():
            if os.path.lexists(temp):
                os.remove(temp)
            os.close(fd)

    def _seal(self, state):
        """``(host, header)``: ``state``'s arrays copied to host (on the
        calling thread), its metadata with the manifest and the CRC-32 of
        its data (the arrays' bytes in sorted key order, the order written:
        ``_read_arrays`` checks it run by run)."""
        import numpy as np

        arrays = {
            k: np.asarray(state.arrays[k], order="C") for k in sorted(state.arrays)
        }
        host = HostPromptCache(arrays, state.dtypes, dict(state.metadata))
        header = host.header()
        host.metadata["0.manifest"] = self._manifest(header)
        crc = 0
        for k in sorted(host.arrays):
            a = host.arrays[k]
            crc = zlib.crc32(a.astype(a.dtype.newbyteorder("<"), copy=False), crc)
        host.metadata["0.crc32"] = str(crc)
        return host, header

    def _array(self, spec: dict, data):
        """The MLX array of ``data`` (bytes read), as header ``spec`` says."""
        dtype = getattr(mx, self.dtypes[spec["dtype"]])
        return mx.array(self._host(spec, data)).view(dtype)

    def _host(self, spec: dict, data):
        """``data`` (bytes read) as header ``spec``'s shape, in unsigned
        integers of its dtype's size (its bits, on the host)."""
        size = getattr(mx, self.dtypes[spec["dtype"]]).size
        return data.view(f"<u{size}").reshape(spec["shape"])

    @staticmethod
    def _views(state):
        """A queued entry's or block's arrays (``HostPromptCache``), each
        viewed as its own dtype."""
        return {
            k: a.view(getattr(mx, state.dtypes[k])) for k, a in state.arrays.items()
        }

    def _join(self, arrays: dict, metadata: dict, found: Dict[str, list]):
        """``arrays`` (an entry's, its shared layers' tails) with each shared
        layer's blocks before its tail (none without ``0.blocks`` in its
        ``metadata``); ``found``: key -> its blocks' arrays in order (a
        run of blocks may be one array)."""
        if "0.blocks" not in metadata:
            return arrays
        layers, out = json.loads(metadata["0.blocks"])["layers"], dict(arrays)
        for i, suffixes in self._shared_keys(arrays, layers).items():
            for k in (f"{i}.{s}" for s in suffixes):  # on the device, one copy
                out[k] = mx.concatenate([*found[k], arrays[k]], axis=2)
        return out

    def _with_blocks(self, entry: tuple, header: dict, arrays: dict):
        """``arrays``, read from the entry file of ``header`` (``entry``: its
        model and tokens, ...), with its block files' joined in; raises
        ``ValueError`` for a format this does not read."""
        version = header["__metadata__"].get("0.format", "1")  # 1: whole entries
        if version not in ("1", "2"):
            raise ValueError(f"it is in format {version!r}; this reads 1 and 2")
        if "0.blocks" not in header["__metadata__"]:
            return arrays
        found = self._read_blocks(entry[0], entry[1], header)
        return self._join(arrays, header["__metadata__"], found)

    def _read_blocks(self, model: str, tokens: List[int], header: dict):
        """``{block file name: {key: MLX array}}`` of the block files the
        entry of ``header`` names, read in parallel and each checked: named
        as its entry's model, tokens and layers make it, its own header
        saying so, sealed, and holding the dtypes and shapes its entry's
        layers need. Raises ``ValueError`` naming what is wrong."""
        import numpy as np

        meta = json.loads(header["__metadata__"]["0.blocks"])
        size, files = meta["size"], meta["files"]
        keys = self._shared_keys(header, meta["layers"])
        specs = {i: {s: header[f"{i}.{s}"] for s in x} for i, x in keys.items()}
        counts = {}  # layer -> (blocks, layout)
        for i, n in meta["layers"].items():
            if not (type(n) is int and 0 < n and i in specs):
                raise ValueError(f"its layer {i} names {n!r} blocks")
            arrays = {
                s: (self.dtypes[v["dtype"]], v["shape"]) for s, v in specs[i].items()
            }
            name = header["__metadata__"].get(f"1.{i}")
            counts[int(i)] = (n, self._layout(name, arrays))
        want = self._block_names(model, tokens, size, counts)
        if [name for name, _, _ in want] != files:
            raise ValueError("it names block files its model, tokens and layers do not")
        layouts = {}  # id of a held list -> its JSON, its arrays' dtypes and shapes
        for _, held, _ in want:
            if id(held) not in layouts:
                arrays = {
                    f"{i}.{s}": [v["dtype"], v["shape"][:2] + [size] + v["shape"][3:]]
                    for i, _ in held
                    for s, v in specs[str(i)].items()
                }
                layouts[id(held)] = (json.dumps(held), arrays)

        # Runs of blocks of one layout, at most the bytes the threads read at
        # once, each read into one MLX buffer made here (streams are this
        # thread's): the threads write its rows through numpy views, with no
        # ``mx.array`` copy (it holds the GIL they need) and no stack. The
        # next run's buffer is made while they read one, which is joined
        # while they read the next; the first run is one block, so reading
        # starts once a block's buffer is made. A buffer is zeroed on the
        # default device: on CUDA the GPU's, moved to unified memory in one
        # copy (zeroed on the CPU, its pages were first touched one by one).
        runs, cap = [], self.read_threads * self.read_chunk
        for name, held, digest in want:
            n = sum(
                math.prod(shape) * getattr(mx, self.dtypes[dtype]).size
                for dtype, shape in layouts[id(held)][1].values()
            )
            most = cap if len(runs) > 1 else n
            if not runs or runs[-1][0] != id(held) or (len(runs[-1][1]) + 1) * n > most:
                runs.append((id(held), [], n))
            runs[-1][1].append((name, held, digest))

        def read(name, held, digest, into):
            path, st = os.path.join(self.directory, name), None
            try:
                st = os.lstat(path)
                if not stat.S_ISREG(st.st_mode):
                    raise ValueError("not a regular file")
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except FileNotFoundError:
                raise ValueError(f"its block {name} is missing") from None
            except (OSError, ValueError) as e:  # set aside: written when named
                if st is not None and getattr(e, "errno", None) in (
                    None,
                    *self.unreadable,
                ):
                    self._remove_unsound(name, st)
                raise ValueError(f"block {name}: {e!r}") from None
            try:
                st = os.fstat(fd)
                got, _ = self._safetensors_header(fd)
                m, (text, arrays) = got["__metadata__"], layouts[id(held)]
                if [m.get("0.model"), m.get("0.layers"), m.get("0.chain")] != [
                    model,
                    text,
                    digest,
                ]:
                    raise ValueError(f"its block {name} holds another block")
                if arrays != {
                    k: [g["dtype"], g["shape"]]
                    for k, g in got.items()
                    if k != "__metadata__"
                }:
                    raise ValueError(f"its block {name} is not its layout")
                self._read_arrays(fd, got, into=into)
            except (OSError, ValueError) as e:  # unsound: removed, written again
                if getattr(e, "errno", None) in (None, *self.unreadable):
                    self._remove_unsound(name, st)
                raise ValueError(f"block {name}: {e}") from None
            finally:
                os.close(fd)
            del got["__metadata__"]
            return got

        def queue(blocks, n):  # a run's buffer and its reads
            device = mx.default_device()
            buffer = mx.zeros((len(blocks), n), mx.uint8, stream=device)
            buffer = mx.contiguous(buffer, stream=device)
            rows, pool = np.asarray(buffer), self._block_threads()
            return buffer, [
                pool.submit(read, *x, rows[i]) for i, x in enumerate(blocks)
            ]

        found, queued = {}, queue(*runs[0][1:]) if runs else None
        for i in range(len(runs)):
            (buffer, reads), queued = queued, (
                queue(*runs[i + 1][1:]) if i + 1 < len(runs) else None
            )
            try:
                got = [f.result() for f in reads]
            except BaseException:
                for f in reads + (queued[1] if queued else []):
                    f.cancel()
                raise
            start = 0  # rows of one header: one run to join
            for row in range(1, len(got) + 1):
                if row == len(got) or got[row] != got[start]:
                    self._add_run(found, got[start], buffer, start, row)
                    start = row
        return found

    def _add_run(self, found: Dict[str, list], specs, data, start: int, stop: int):
        """Append to ``found`` (key -> arrays in block order) each array of
        ``specs`` (a block file's header, the same in each block of the
        run) across rows ``start:stop`` of ``data`` (MLX bytes, a block
        file's a row), one array per key, scheduled: a few operations a
        key, not a few per block, moving the widest words its layout
        allows (a copy a byte at a time is 3-4x slower on the CPU)."""
        words = {}  # the rows as unsigned words of w bytes
        for k, v in specs.items():
            begin, end = v["data_offsets"]
            shape, dtype = v["shape"], getattr(mx, self.dtypes[v["dtype"]])
            row = (end - begin) // math.prod(shape[:3])  # a token's bytes
            w = next(w for w in (8, 4, 2, 1) if (begin | row | data.shape[1]) % w == 0)
            if w not in words:
                words[w] = data[start:stop].view(getattr(mx, f"uint{8 * w}"))
            x = words[w][:, begin // w : end // w]
            x = x.reshape(stop - start, *shape[:3], -1).transpose(1, 2, 0, 3, 4)
            x = x.reshape(*shape[:2], -1, x.shape[-1]).view(dtype)
            found.setdefault(k, []).append(x.reshape(*shape[:2], -1, *shape[3:]))
        mx.async_eval([x[-1] for x in found.values()])

    def _block_threads(self):
        """The threads reading block files and joining them."""
        from concurrent.futures import ThreadPoolExecutor

        if self._blocks_pool[0] != self.read_threads:
            pool = ThreadPoolExecutor(self.read_threads)
            self._blocks_pool = (self.read_threads, pool)
        return self._blocks_pool[1]

    def _refs(self, name: str):
        """The block files the entry file ``name`` names (none if its header
        is not sound); kept per name, inode and ctime (a file renamed over
        it, or touched, is read again)."""
        path = os.path.join(self.directory, name)
        try:
            st = os.lstat(path)
            seen = (st.st_ino, st.st_ctime_ns)
            if self._refs_seen.get(name, (None,))[0] != seen:
                header = self._read_header(path, full=True)[1]
                self._refs_seen[name] = (seen, set(self._named_blocks(header)))
        except Exception:
            self._refs_seen.pop(name, None)  # counted as naming none
            return set()
        return self._refs_seen[name][1]

    @staticmethod
    def _named_blocks(header: dict) -> List[str]:
        """The block files the entry file of ``header`` names."""
        blocks = header["__metadata__"].get("0.blocks")
        return json.loads(blocks)["files"] if blocks else []

    def _entry_bytes(self, name: str):
        """The bytes a restore of indexed entry ``name`` reads; of a queued
        one, the bytes its file and block files will hold: joining it costs
        a copy of each (on a GPU, there and back), not nothing."""
        state = self._pending.get(name)
        if state is not None:
            return state.nbytes + sum(b.nbytes for b in state.blocks.values())
        return self._restore_bytes(self._files[name][3], self._refs(name))

    def _restore_bytes(self, size: int, blocks):
        """The bytes a restore reads: an entry file of ``size`` bytes and
        its ``blocks`` files (``read_rate`` and the cost model count all)."""
        for block in blocks:
            try:
                size += os.stat(os.path.join(self.directory, block)).st_size
            except OSError:
                pass
        return size

    def _shrink(self, free: int = 0, room: int = 0, keep=()):
        """Count every entry file, block file, temporary file and file of
        what is known (``digests_file``, ``rates_file``) in the directory
        (other processes' too) and remove the least recently used
        entries until they fit ``max_bytes`` less ``room`` (what a write is
        about to add) and, with ``free``, take ``free`` fewer bytes; a block
        file goes when no remaining entry (nor ``keep``, the blocks of the
        entry being written) names it. Returns the bytes removed. Called
        with the directory locked."""
        found, blocks, temps = [], {}, 0
        for e in os.scandir(self.directory):
            if self._is_entry(e.name) or self._is_block(e.name):
                try:
                    st = os.lstat(e.path)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                if self._is_entry(e.name):
                    found.append((st.st_mtime_ns, e.name, st.st_size))
                else:
                    blocks[e.name] = st.st_size
            elif (
                self._is_temp(e.name)
                and not self._remove_stale(e.path)
                or e.name.startswith((self.digests_file, self.rates_file))
            ):  # a live writer's temporary file (or a recent one's), what is known
                try:
                    temps += e.stat(follow_symlinks=False).st_size
                except OSError:
                    pass
        refs = {b: 1 for b in keep}
        for name in set(self._refs_seen) - {name for _, name, _ in found}:
            del self._refs_seen[name]  # removed by another process
        for _, name, _ in found:
            for block in self._refs(name):
                refs[block] = refs.get(block, 0) + 1
        total = sum(size for _, _, size in found) + sum(blocks.values()) + temps
        limit = min(self.max_bytes - room, total - free)
        removed = sum(blocks[b] for b in blocks if not refs.get(b) and self._unlink(b))
        with self._lock:
            self._forget({name for _, name, _ in found})
            for _, name, size in sorted(found):
                if total - removed <= limit:
                    break
                if not self._unlink(name):
                    continue
                removed += size
                if name in self._files and name not in self._pending:
                    self._drop(name)  # a queued one is written again
                for b in self._refs_seen.pop(name, (0, ()))[1] & set(refs):
                    refs[b] -= 1
                    if refs[b] == 0 and b in blocks and self._unlink(b):
                        removed += blocks[b]
        self._n_bytes = total - removed
        return removed

    def _unlink(self, name: str):
        """Remove file ``name``; whether it is gone."""
        try:
            os.remove(os.path.join(self.directory, name))
        except FileNotFoundError:
            pass
        except OSError as e:
            logging.warning(f"[prompt cache] could not remove {name}: {e!r}")
            return False
        return True
