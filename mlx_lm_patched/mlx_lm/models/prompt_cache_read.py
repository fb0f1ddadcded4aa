"""Reading prompt-cache files one cannot trust: a header of bounded size,
each field checked and the whole matching its manifest digest; the arrays
read by threads, each chunk checked (CRC-32, finite floats) as it comes."""

import bisect
import hashlib
import json
import math
import os
import stat
import zlib

import mlx.core as mx


class PromptCacheReader:
    """How ``PromptCacheDir`` reads its files: ``_safetensors_header`` and
    ``_read_arrays``."""

    # Bytes of header a scan reads at most (a 1M-token prompt takes ~8 MB).
    header_limit = 64 << 20

    # Threads reading an entry's data; bytes a read at most (a multiple of 8).
    read_threads = 8
    read_chunk = 16 << 20

    # (read_threads, the threads reading entries), made at the first read
    _pool = (0, None)

    # safetensors dtype: MLX dtype
    dtypes = {
        "BOOL": "bool", "U8": "uint8", "U16": "uint16", "U32": "uint32",
        "U64": "uint64", "I8": "int8", "I16": "int16", "I32": "int32",
        "I64": "int64", "F16": "float16", "BF16": "bfloat16",
        "F32": "float32", "F64": "float64",
    }  # fmt: skip

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
        for k, v in header.items():  # checks at C speed: a block file has 192
            if k == "__metadata__":
                continue
            v = v if type(v) is dict else {}
            shape, offsets = v.get("shape"), v.get("data_offsets")
            if not (
                v.get("dtype") in self.dtypes
                and type(shape) is list
                and type(offsets) is list
                and len(offsets) == 2
                and set(map(type, shape + offsets)) <= {int}
                and min(shape, default=0) >= 0
            ):
                raise ValueError(f"array {k!r} has a malformed dtype, shape or offsets")
            itemsize = getattr(mx, self.dtypes[v["dtype"]]).size
            if offsets[1] - offsets[0] != math.prod(shape) * itemsize:
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

    def _read_arrays(self, fd: int, header: dict, each=None, into=None):
        """The data of the entry file open on ``fd`` (``header``, its checked
        header), a numpy buffer of bytes (``into`` where given: one of the
        size its checked header fixes); with ``each``, ``each(key, bytes)``
        is called for each array, in file order, as soon as it is read.
        ``read_threads`` threads read its data in runs of
        ``read_chunk`` bytes, across arrays, into one preallocated numpy
        buffer (a block file of 64 arrays is one read), and CRC-32 each run
        (zlib releases the GIL). Each float array is checked to have no
        exponent all ones (NaN or infinite), by the threads as they read it
        (back-to-back arrays of a dtype at once; one whose offset is not a
        multiple of its item size, after). Raises ``ValueError`` where one
        has and, once all are read, where the CRC-32 is not the header's
        (``_seal``'s: the arrays' bytes in sorted key order, which is file
        order in the files ``_seal`` writes; others are CRC'd per array)."""
        from concurrent.futures import ThreadPoolExecutor, wait

        import numpy as np

        base = 8 + int.from_bytes(os.pread(fd, 8, 0), "little")
        spans = {k: v["data_offsets"] for k, v in header.items() if k != "__metadata__"}
        keys = sorted(spans)
        ends = [0] + [spans[k][1] for k in keys]
        sealed = [spans[k][0] for k in keys] == ends[:-1]  # sorted, contiguous
        order = keys if sealed else sorted(spans, key=lambda k: spans[k])
        size = max((stop for _, stop in spans.values()), default=0)
        data = np.empty(size, np.uint8) if into is None else into
        view, step = memoryview(data), self.read_chunk
        shifts = {}  # bytes -> _crc32_shift(bytes): a few sizes recur

        def combine(crc1, crc2, n):
            if not crc1:  # nothing before: a file's first run
                return crc2
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

        def finite(raw, exponent):  # bytes of floats: no exponent all ones
            return (raw.view(exponent.dtype) & exponent).max(initial=0) != exponent

        def check(k, start, stop):
            exponent = floats.get(header[k]["dtype"])
            if exponent is not None and not finite(data[start:stop], exponent):
                raise ValueError(f"array {k} holds NaN or infinite values")

        # Float arrays the threads check: [start, stop, exponent, keys], the
        # back-to-back arrays of a dtype joined, by offset; the rest, after.
        ranges, late = [], set()
        for k in order:
            exponent, (start, stop) = floats.get(header[k]["dtype"]), spans[k]
            if exponent is None:
                continue
            if (start | step) % exponent.itemsize:
                late.add(k)
            elif ranges and ranges[-1][1] == start and ranges[-1][2] is exponent:
                ranges[-1][1] = stop
                ranges[-1][3].append(k)
            else:
                ranges.append([start, stop, exponent, [k]])
        starts = [r[0] for r in ranges]

        def read(at, stop):
            done = at
            while done < stop:
                n = os.preadv(fd, [view[done:stop]], base + done)
                if n == 0:
                    raise ValueError("it was truncated while it was read")
                done += n
            i = max(bisect.bisect_right(starts, at) - 1, 0)
            for start, end, exponent, ks in ranges[i:]:
                if start >= stop:
                    break
                lo, hi = max(start, at), min(end, stop)
                if lo < hi and not finite(data[lo:hi], exponent):
                    for k in ks:  # the array that holds it
                        check(k, max(spans[k][0], lo), min(spans[k][1], hi))
            return zlib.crc32(view[at:stop])

        if self._pool[0] != self.read_threads:  # kept: threads take ms to start
            self._pool = (self.read_threads, ThreadPoolExecutor(self.read_threads))
        pool = self._pool[1]
        runs = [
            (i, min(i + step, size), pool.submit(read, i, min(i + step, size)))
            for i in range(0, size, step)
        ]

        try:
            run, crc = 0, 0
            for k in order:
                start, stop = spans[k]
                while run < len(runs) and runs[run][0] < stop:  # read up to it
                    at, end, part = runs[run]
                    crc, run = combine(crc, part.result(), end - at), run + 1
                if k in late:
                    check(k, start, stop)
                if each is not None:
                    each(k, data[start:stop])
        finally:  # on any error, no thread reads ``fd`` once this returns
            for _, _, part in runs:
                part.cancel()
            wait([part for _, _, part in runs])
        if not sealed:  # not _seal's layout: the arrays' CRC-32s in key order
            crc = 0
            for k in keys:
                start, stop = spans[k]
                crc = combine(crc, zlib.crc32(view[start:stop]), stop - start)
        if crc != int(header["__metadata__"].get("0.crc32", "-1")):
            raise ValueError("its data does not match its CRC-32")
        return data

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
