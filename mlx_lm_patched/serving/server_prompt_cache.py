"""The server's prompt cache holds ``--prompt-cache-bytes``.

Upstream's ``run`` builds ``LRUPromptCache(prompt_cache_size)`` with no byte
limit, and ``_generate`` trims it only when a request joins the batch: the
caches inserted at the ends of segments and requests, and every request
served one at a time (``_serve_single``), grow it past the budget
(ml-explore/mlx-lm#1390, #1807). Here ``run`` gives the prompt cache
``max_bytes``, so every insert evicts down to the budget on every path; the
batched path also trims after every batch step to the budget less what the
running batch holds (``server_kv_bits``'s ``_generate``). The size the
server logs before each request is exact (``... 0.00 GB (1638400 B)``):
GB to two decimals hid every budget under 5 MB.

``--prompt-cache-bits {4,8}`` (with ``--prompt-cache-group-size``, default
64) keeps the prompt cache's entries quantized at rest, in memory and on
disk (``prompt_cache_store``): about 0.53x and 0.28x of bfloat16's bytes,
dequantized when a request takes one, so requests compute at their own
precision.

``--prompt-cache-dir DIR`` gives the prompt cache a disk tier
(``prompt_cache_disk``): every entry memory stores is queued at once and
written to DIR by a background thread (``--prompt-cache-queue-bytes``,
default 1G, bounds the queue; what does not fit is not written, and the
log counts it), read back where memory has less of a prompt, and found
again after a restart, also after kill -9. Stopped with SIGTERM (systemd,
docker, Kubernetes; upstream dies at once and keeps nothing) or Ctrl-C,
the server writes the queue and what memory holds for at most
``DiskPromptCache.drain_seconds`` (10 s), then exits 0 (a second SIGTERM
while it writes ends it at once: ``server_http``).
``--prompt-cache-disk-bytes`` (default 16G) bounds DIR. Its files hold the
keys and values of users' prompts: written ``0600``, a directory made
``0700`` (``--prompt-cache-mode``, for replicas of one group: ``660``;
before, ``os.open`` without a mode made them ``0755``). At start the
log gives the disk entries found (count, bytes) and the budgets in force;
then both tiers' sizes before each request and which tier served how many
of its tokens. Upstream's ``main`` builds its parser inline, so it is here whole,
with the flags added. Its size flags took upstream's ``_parse_size``, whose
``-1``, ``abc`` and ``10K`` end in a traceback: ``_parse_byte_size`` takes
``4096``, ``10K``, ``4M``, ``2G``, ``1T`` (and ``KiB``... in powers of 1024)
or gives argparse's one-line error, as ``--prompt-cache-dir`` does for a
file or a directory it cannot list (``_prompt_cache_dir``).
``--listen-backlog``, ``--max-connections`` and ``--idle-timeout`` size the
HTTP server for bursts (``server_http``).
"""

from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING

from mlx_lm.server import APIHandler, ModelProvider

from .._registry import Patch, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    import argparse
    import json
    import logging
    import time

    import mlx.core as mx
    from mlx_lm.server import (
        DEFAULT_QUANTIZED_KV_START,
        LRUPromptCache,
        Path,
        _run_http_server,
        maybe_set_recommended_wired_limit,
    )


# Written as it reads in mlx_lm/server.py, and runs there.
def run(
    host: str,
    port: int,
    model_provider: ModelProvider,
    server_class=ThreadingHTTPServer,
    handler_class=APIHandler,
):
    group = mx.distributed.init()
    cli_args = model_provider.cli_args
    # Entries quantized at rest (RAM and disk); the batch computes at its own.
    at_rest = {
        "bits": getattr(cli_args, "prompt_cache_bits", None),
        "group_size": getattr(cli_args, "prompt_cache_group_size", 64),
    }
    if cli_args.prompt_cache_dir is None:
        prompt_cache = LRUPromptCache(cli_args.prompt_cache_size, **at_rest)
    else:
        from .models.cache import DiskLRUPromptCache, DiskPromptCache

        # One directory per rank: each holds its own shard of the caches.
        directory = Path(cli_args.prompt_cache_dir)
        if group.size() > 1:
            directory = directory / f"rank{group.rank()}"
        disk = DiskPromptCache(
            str(directory),
            cli_args.prompt_cache_disk_bytes,
            cli_args.prompt_cache_queue_bytes,
            getattr(cli_args, "prompt_cache_mode", 0o600),
            digest_wait=False,
        )
        # Caches quantized otherwise are other entries: never served across.
        disk.scope = " ".join(
            f"--{k} {getattr(cli_args, k.replace('-', '_'), None)}"
            for k in (
                "kv-bits",
                "kv-group-size",
                "prompt-cache-bits",
                "prompt-cache-group-size",
            )
        )
        prompt_cache = DiskLRUPromptCache(disk, cli_args.prompt_cache_size, **at_rest)
        # The weights' digest (entries' model key) is read on a thread from
        # now, not by the first request (an 8B model's 16 GB: 14 s on an
        # H200's host); requests miss the disk tier until it is known.
        default = ("model", "adapter_path", "draft_model")
        disk._model_key(tuple(getattr(cli_args, k, None) for k in default), wait=False)
    if cli_args.prompt_cache_bytes is not None:
        prompt_cache.max_bytes = cli_args.prompt_cache_bytes
    # What the server starts with, and the budgets it holds.
    held = f"{cli_args.prompt_cache_size} entries"
    if cli_args.prompt_cache_bytes is not None:
        held += f", {cli_args.prompt_cache_bytes} B with the running batch"
    line = f"Prompt cache: memory holds at most {held}"
    if cli_args.prompt_cache_dir is not None:
        line += (
            f"; disk: {len(disk)} entries ({disk.nbytes} B) found in "
            f"{directory}, holds at most {disk.max_bytes} B, queues at most "
            f"{disk.queue_bytes} B"
        )
    if getattr(cli_args, "max_kv_size", None) is not None:
        line += f"; caches are rings of {cli_args.max_kv_size} tokens"
    logging.info(line)
    response_generator = ResponseGenerator(model_provider, prompt_cache)
    # Stopped by SIGTERM as on Ctrl-C (server_http).
    if group.rank() == 0:
        _run_http_server(host, port, response_generator)
    else:
        response_generator.join()
    if cli_args.prompt_cache_dir is not None:
        # Stopped: what is queued and what memory holds are written, in a
        # bounded time (memory's only once the generation thread is done
        # with it: its entries are queued as they are made).
        if not response_generator._generation_thread.is_alive():
            prompt_cache.trim_to(n_sequences=0)
        logging.info(
            f"Prompt cache: writing {disk.queued} entries "
            f"({disk.queued_bytes} B) to {directory}, for at most "
            f"{disk.drain_seconds} s"
        )
        start, before = time.perf_counter(), (disk.written, disk.dropped)
        left = disk.close(timeout=disk.drain_seconds)
        written, dropped = disk.written - before[0], disk.dropped - before[1]
        logging.info(
            f"Prompt cache: written {written} entries in "
            f"{time.perf_counter() - start:.2f} s"
            + (f", {dropped} not written (warned)" if dropped else "")
            + (f", {left} entries left unwritten" if left else "")
        )


def _file_mode(x: str) -> int:
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


def _parse_byte_size(x: str) -> int:
    """Bytes from ``4096``, ``10K``, ``4M``, ``2.5G``, ``1T``: powers of 1000
    as in upstream's ``_parse_size`` (``KB``, ``MB``, ... too), ``KiB``,
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


def _prompt_cache_dir(x: str, mode: int = 0o600) -> str:
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


class ResponseGenerator:
    def _log_cache_stats(self):
        n_sequences = len(self.prompt_cache)
        n_bytes = self.prompt_cache.nbytes
        logging.info(
            f"Prompt Cache: {n_sequences} sequences, {n_bytes / 1e9:.2f} GB "
            f"({n_bytes} B)"
        )
        for cache_type, stats in self.prompt_cache.stats_by_type().items():
            n_sequences = stats["n_sequences"]
            n_bytes = stats["n_bytes"]
            logging.info(
                f"- {cache_type}: {n_sequences} sequences, {n_bytes / 1e9:.2f} GB"
            )
        disk = getattr(self.prompt_cache, "disk", None)
        if disk is not None:
            n_bytes = disk.nbytes
            logging.info(
                f"- disk: {len(disk)} sequences, {n_bytes / 1e9:.2f} GB ({n_bytes} B), "
                f"{disk.queued} queued ({disk.queued_bytes} B), "
                f"{disk.dropped} dropped"
            )


def main():
    parser = argparse.ArgumentParser(
        description="%(prog)s: an OpenAI-compatible HTTP server for MLX models "
        "(mlx-lm's, with mlx-lm-patched's caches): batched requests, a prompt "
        "cache in memory and, with --prompt-cache-dir, on disk."
    )
    parser.add_argument(
        "--model",
        type=str,
        help="The path to the MLX model weights, tokenizer, and config",
    )
    parser.add_argument(
        "--adapter-path",
        type=str,
        help="Optional path for the trained adapter weights and config.",
    )
    parser.add_argument(
        "--host",
        type=str,
        default="127.0.0.1",
        help="Host for the HTTP server (default: 127.0.0.1)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=8080,
        help="Port for the HTTP server (default: 8080)",
    )
    parser.add_argument(
        "--allowed-origins",
        type=lambda x: x.split(","),
        default="*",
        help="Allowed origins (default: *)",
    )
    parser.add_argument(
        "--draft-model",
        type=str,
        help="A model to be used for speculative decoding (requests are then "
        "served one at a time); works with --max-kv-size and sliding-window "
        "models",
        default=None,
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=int,
        help="Number of tokens to draft when using speculative decoding "
        "(default: 3)",
        default=3,
    )
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="Enable trusting remote code for tokenizer",
    )
    parser.add_argument(
        "--log-level",
        type=str,
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
        help="Set the logging level (default: INFO)",
    )
    parser.add_argument(
        "--chat-template",
        type=str,
        default="",
        help="Specify a chat template for the tokenizer",
        required=False,
    )
    parser.add_argument(
        "--use-default-chat-template",
        action="store_true",
        help="Use the default chat template",
    )
    parser.add_argument(
        "--temp",
        type=float,
        default=0.0,
        help="Default sampling temperature (default: 0.0)",
    )
    parser.add_argument(
        "--top-p",
        type=float,
        default=1.0,
        help="Default nucleus sampling top-p (default: 1.0)",
    )
    parser.add_argument(
        "--top-k",
        type=int,
        default=0,
        help="Default top-k sampling (default: 0, disables top-k)",
    )
    parser.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="Default min-p sampling (default: 0.0, disables min-p)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=512,
        help="Default maximum number of tokens to generate (default: 512)",
    )
    parser.add_argument(
        "--chat-template-args",
        type=json.loads,
        help="""A JSON formatted string of arguments for the tokenizer's apply_chat_template, e.g. '{"enable_thinking":false}'""",
        default="{}",
    )
    parser.add_argument(
        "--decode-concurrency",
        type=int,
        default=32,
        help="When a request is batchable then decode that many requests in "
        "parallel (default: 32)",
    )
    parser.add_argument(
        "--prompt-concurrency",
        type=int,
        default=8,
        help="When a request is batchable then process that many prompts in "
        "parallel (default: 8)",
    )
    parser.add_argument(
        "--prefill-step-size",
        type=int,
        default=2048,
        help="Step size for prefill processing (default: 2048)",
    )
    parser.add_argument(
        "--prompt-cache-size",
        type=int,
        default=10,
        help="Maximum number of distinct KV caches to hold in the prompt "
        "cache in memory (default: 10)",
    )
    parser.add_argument(
        "--prompt-cache-bytes",
        type=_parse_byte_size,
        help="Maximum size of the prompt cache in memory plus the running "
        "batch's caches, held after every insert and batch step: bytes, or "
        "with a unit: 500M, 2G, 1.5G, 4GiB (default: no limit)",
    )
    parser.add_argument(
        "--prompt-cache-dir",
        help="Directory for a disk tier of the prompt cache (made if missing): "
        "every entry is written there as it is made, by a background thread, "
        "served from there where memory holds less of a prompt, and found "
        "again after a restart (default: none, memory only)",
    )
    parser.add_argument(
        "--prompt-cache-disk-bytes",
        type=_parse_byte_size,
        default="16G",
        help="Maximum size of the --prompt-cache-dir files, oldest removed "
        "first: bytes, or 500M, 16G... (default: 16G)",
    )
    parser.add_argument(
        "--prompt-cache-queue-bytes",
        type=_parse_byte_size,
        default="1G",
        help="Maximum size of the prompt caches waiting to be written "
        "to --prompt-cache-dir; more are not written, and the log counts "
        "them (default: 1G)",
    )
    parser.add_argument(
        "--prompt-cache-mode",
        type=_file_mode,
        default="600",
        help="Permissions of the files written to --prompt-cache-dir, in "
        "octal, less the umask; a directory made gets x where they have r. "
        "The files hold the keys and values of users' prompts: the default "
        "is the owner only (default: 600, directories 700); replicas running "
        "as users of one group share a directory with 660 (and umask 007)",
    )
    parser.add_argument(
        "--prompt-cache-bits",
        type=int,
        choices=[4, 8],
        help="Keep prompt cache entries quantized to 4 or 8 bits at rest, in "
        "memory and on disk; requests still compute at their own precision "
        "(default: none, entries as the requests' caches)",
    )
    parser.add_argument(
        "--prompt-cache-group-size",
        type=int,
        choices=[32, 64, 128],
        default=64,
        help="Group size of --prompt-cache-bits (default: 64)",
    )
    # A chat template's re-rendered tail (an end-of-turn marker, a stripped
    # space, a changed last word) is a few tokens.
    parser.add_argument(
        "--prompt-cache-slack",
        type=int,
        default=8,
        help="Tokens a rotating cache layer (a sliding window, a --max-kv-size "
        "ring) can be trimmed back after it wraps, so a chat whose client "
        "re-renders the end of the previous answer reuses its cache; at most "
        "the window (default: 8)",
    )
    # Four of them (``max_checkpoints``) cover the last 2,048 tokens.
    parser.add_argument(
        "--prompt-cache-checkpoint-every",
        type=int,
        default=512,
        help="Rotating cache layers keep a copy of their window every this "
        "many tokens of a prompt (the newest 4), so a request that branches "
        "off a cached prompt past the window prefills from the nearest one; "
        "0: none (default: 512)",
    )
    parser.add_argument(
        "--max-kv-size",
        type=int,
        help="Tokens of cache a layer keeps for each conversation: "
        "full-attention layers become rings of this many tokens that keep the "
        "first 4 (RotatingKVCache(N, keep=4)), sliding-window layers a window "
        "no larger; the prompt cache holds the rings (default: none, "
        "unbounded)",
    )
    parser.add_argument(
        "--kv-bits",
        type=int,
        default=None,
        help="Bits of the quantized KV cache: 2, 3, 4, 5, 6 or 8, from "
        "--quantized-kv-start on; every cache, rings included; requests are "
        "still batched (default: none, full precision)",
    )
    parser.add_argument(
        "--kv-group-size",
        type=int,
        default=64,
        help="Group size for KV cache quantization (default: 64)",
    )
    parser.add_argument(
        "--quantized-kv-start",
        type=int,
        default=DEFAULT_QUANTIZED_KV_START,
        help="With --kv-bits, quantize a cache once it holds this many "
        "tokens; 0 quantizes from the first token "
        f"(default: {DEFAULT_QUANTIZED_KV_START})",
    )
    parser.add_argument(
        "--pipeline",
        action="store_true",
        help="Use pipelining instead of tensor parallelism",
    )
    parser.add_argument(
        "--listen-backlog",
        type=int,
        default=1024,
        help="Connections the kernel holds until the server accepts them "
        "(default: 1024)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=256,
        help="Connections served at once, each by a thread; more get a 503 "
        "(default: 256)",
    )
    parser.add_argument(
        "--idle-timeout",
        type=float,
        default=60.0,
        help="Seconds a connection may send nothing before it is closed "
        "(default: 60)",
    )
    args = parser.parse_args()
    if args.max_kv_size is not None and args.max_kv_size < 1:
        parser.error(f"--max-kv-size must be >= 1, got {args.max_kv_size}")
    for flag in ("listen_backlog", "max_connections", "idle_timeout"):
        if not getattr(args, flag) > 0:
            parser.error(f"--{flag.replace('_', '-')} must be positive")
    if args.prompt_cache_dir is not None:
        try:  # made with the mode, known only now
            _prompt_cache_dir(args.prompt_cache_dir, args.prompt_cache_mode)
        except argparse.ArgumentTypeError as e:
            parser.error(f"argument --prompt-cache-dir: {e}")
    _ = maybe_set_recommended_wired_limit()

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), None),
        format="%(asctime)s - %(levelname)s - %(message)s",
    )
    run(args.host, args.port, ModelProvider(args))


PATCH = Patch(
    "server_prompt_cache",
    "server: --prompt-cache-bytes holds on every insert and after every batch "
    "step; --prompt-cache-dir writes prompt caches to disk as they are made, "
    "drained on SIGTERM and Ctrl-C; the log shows both tiers; "
    "--prompt-cache-bits keeps them quantized at rest; files 0600 "
    "(--prompt-cache-mode); a start-up line with the entries found and the "
    "budgets; bad sizes and "
    "directories are one-line errors",
    targets("mlx_lm.server", run, main, _file_mode, _parse_byte_size, _prompt_cache_dir)
    + targets("mlx_lm.server:ResponseGenerator", ResponseGenerator),
    requires=(
        "mlx_lm.models.cache:LRUPromptCache.trim_to",
        "mlx_lm.models.cache:DiskLRUPromptCache",
    ),
)
