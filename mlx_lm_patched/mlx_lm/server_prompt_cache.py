"""The server's prompt cache flags (byte sizes, a file mode, a directory it
can list), its size and the prompt-cache timings it logs, and a chat's
tokens resumed from an earlier chat's."""

import argparse
import logging
import time
from pathlib import Path
from typing import Sequence


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


def cache_size(prompt_cache) -> str:
    """``prompt_cache``'s size as the server logs it, exact in bytes (GB to
    two decimals hid every budget under 5 MB; ``bench serve`` reads it)."""
    n_bytes = prompt_cache.nbytes
    return f"{len(prompt_cache)} sequences, {n_bytes / 1e9:.2f} GB ({n_bytes} B)"


def log_timing(timing, phase):
    """Log a request's breakdown at DEBUG: the milliseconds each phase took
    (``fetch``: the prompt cache's lookup, its disk tier's too; ``make``: a
    new cache where it had none; ``first_token``: from joining the batch;
    ``store``: its entry's insert
    once answered, and ``segments`` the inserts of its prompt's segment
    caches, made once its first token with text is out), each phase logged
    once."""
    if phase in timing:
        return
    timing[phase] = time.perf_counter()
    if phase == "first_token":
        steps = ("tokenize", "prepare", "fetch", "make", "insert", "first_token")
        before = ["start", *steps]
    else:
        steps, before = ("store",), ("done",)
    parts = " ".join(
        f"{k}={(timing[k] - timing[b]) * 1e3:.1f}ms" for k, b in zip(steps, before)
    )
    if phase == "store":  # and the inserts at its segments' ends
        parts += f" segments={timing.get('segments', 0.0) * 1e3:.1f}ms"
    logging.debug(f"prompt-cache timing: {parts}")


def resumable(tokenizer):
    """``(encoder, cuts, longest)``: the ``tokenizers.Tokenizer`` that
    encodes for ``tokenizer`` (an mlx-lm ``TokenizerWrapper`` or a Hugging
    Face fast tokenizer), the text of each added token an encoding can
    resume at (neither normalized nor stripping) by id, and the longest
    added token's length. None where there is no such tokenizer or it
    truncates, pads or splits special tokens."""
    from tokenizers import Tokenizer

    hf, encoder = tokenizer, getattr(tokenizer, "_tokenizer", None)
    if not isinstance(encoder, Tokenizer):  # mlx-lm's wrapper of one
        hf, encoder = encoder, getattr(encoder, "_tokenizer", None)
    if not isinstance(encoder, Tokenizer) or getattr(hf, "split_special_tokens", 0):
        return None
    if encoder.truncation is not None or encoder.padding is not None:
        return None
    added = encoder.get_added_tokens_decoder()
    cuts = {
        i: t.content
        for i, t in added.items()
        if not (t.normalized or t.lstrip or t.rstrip or t.single_word)
    }
    longest = max((len(t.content) for t in added.values()), default=0)
    return (encoder, cuts, longest) if cuts else None


def common_prefix(a: Sequence, b: Sequence) -> int:
    """The length of the longest common prefix of ``a`` and ``b`` (texts,
    or token lists)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def encode_resumed(encoder, text, known):
    """``(ids, cuts)``: ``text`` encoded (no special tokens added) by
    ``encoder``, a ``resumable`` triple, and where it can be resumed
    (``(index, char)`` of its cut tokens). Of ``known``, earlier ``(text,
    ids, cuts)``, the one sharing the longest prefix gives its tokens up to
    the last cut token both texts hold, with room for any added token before
    it: a tokenizer splits its input at added tokens and encodes the pieces
    apart, so the ids are those of encoding ``text`` whole. An agent's turn
    encodes its new messages only (an 8k-token chat: 12 ms of an H200's
    host, each turn)."""
    tokenizer, cut_ids, longest = encoder
    shared, kept = max(
        ((common_prefix(text, k[0]), k) for k in known), default=(0, None)
    )
    index, start = 0, 0
    for i, c in reversed(kept[2] if kept else ()):
        if c + longest <= shared:
            index, start = i, c
            break
    encoding = tokenizer.encode(text[start:], add_special_tokens=False)
    ids = encoding.ids
    cuts = []
    for j, t in enumerate(ids):
        if t in cut_ids:
            a, b = encoding.token_to_chars(j)  # not the unknown token's stand-in
            if text[start + a : start + b] == cut_ids[t]:
                cuts.append((index + j, start + a))
    if index:
        ids = kept[1][:index] + ids
        cuts = [c for c in kept[2] if c[0] < index] + cuts
    return ids, cuts
