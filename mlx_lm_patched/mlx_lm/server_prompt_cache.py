"""The server's prompt cache flags (byte sizes, a file mode, a directory it
can list) and the prompt-cache timings it logs per request."""

import argparse
import logging
import time
from pathlib import Path


def file_mode(x: str) -> int:
    """Permission bits in octal (``600``, ``660``), the owner's rw among them."""
    try:
        mode = int(x, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777 or mode & 0o600 != 0o600:
        raise argparse.ArgumentTypeError(
            f"{x!r} is not a file mode: octal, readable and writable by the "
            "owner (600, 640, 660)"
        )
    return mode


def parse_byte_size(x: str) -> int:
    """Bytes from ``4096``, ``10K``, ``4M``, ``2.5G``, ``1T``: powers of 1000
    as in ``server._parse_size`` (``KB``, ``MB``, ... too), ``KiB``,
    ``MiB``, ... powers of 1024."""
    text = x.strip().upper()
    binary = text.endswith("IB")
    text = text[:-2] if binary else text[:-1] if text.endswith("B") else text
    unit = text[-1:] if text[-1:] in ("K", "M", "G", "T") else ""
    whole, _, frac = text[: len(text) - len(unit)].strip().partition(".")
    scale = (1024 if binary else 1000) ** ("KMGT".find(unit) + 1) if unit else 1
    digits = whole + frac
    if not (digits.isascii() and digits.isdecimal()) or (binary and not unit):
        raise argparse.ArgumentTypeError(
            f"{x!r} is not a size: a number of bytes, or one with K, M, G or T "
            "(10K, 4M, 2G)"
        )
    return int(whole or 0) * scale + int(frac or 0) * scale // 10 ** len(frac)


def prompt_cache_dir(x: str, mode: int = 0o600) -> str:
    """``x``, a directory the prompt cache can list (made if missing, with x
    where ``mode``, its files', has r)."""
    try:
        path = Path(x)
        path.mkdir(mode | (mode & 0o444) >> 2, parents=True, exist_ok=True)
        if not path.is_dir():
            raise NotADirectoryError(20, "Not a directory")
        next(path.iterdir(), None)
    except OSError as e:
        why = "not a directory" if isinstance(e, FileExistsError) else e.strerror
        raise argparse.ArgumentTypeError(f"{x}: {why or e}") from None
    return x


def log_timing(timing, phase):
    """Log a request's breakdown at DEBUG: the milliseconds each phase took
    (``first_token``: from joining the batch; ``store``: its entry's insert
    once answered, and ``segments`` the inserts of its prompt's segment
    caches, made after its first token), each phase logged once."""
    if phase in timing:
        return
    timing[phase] = time.perf_counter()
    if phase == "first_token":
        steps = ("tokenize", "prepare", "fetch", "insert", "first_token")
        before = ["start", *steps]
    else:
        steps, before = ("store",), ("done",)
    parts = " ".join(
        f"{k}={(timing[k] - timing[b]) * 1e3:.1f}ms" for k, b in zip(steps, before)
    )
    if phase == "store":  # and the inserts at its segments' ends
        parts += f" segments={timing.get('segments', 0.0) * 1e3:.1f}ms"
    logging.debug(f"prompt-cache timing: {parts}")
