"""The server's prompt cache holds ``--prompt-cache-bytes``.

Upstream's ``run`` builds ``LRUPromptCache(prompt_cache_size)`` with no byte
limit, and ``_generate`` trims it only when a request joins the batch: the
caches inserted at the ends of segments and requests, and every request
served one at a time (``_serve_single``), grow it past the budget
(ml-explore/mlx-lm#1390, #1807). Here ``run`` gives the prompt cache
``max_bytes``, so every insert evicts down to the budget on every path; the
batched path also trims after every batch step to the budget less what the
running batch holds (an edit of ``_generate``, which also logs each
request's prompt-cache timings at DEBUG and hands a disk tier the batch's
prefill counters, from which it judges whether a restore from disk pays). The size the
server logs before each request is exact (``... 0.00 GB (1638400 B)``):
GB to two decimals hid every budget under 5 MB.

``--prompt-cache-bits {4,8}`` (with ``--prompt-cache-group-size``, default
64) keeps the prompt cache's entries quantized at rest, in memory and on
disk (``prompt_cache_store``): about 0.53x and 0.28x of bfloat16's bytes,
dequantized when a request takes one, so requests compute at their own
precision.

``--prompt-cache-dir DIR`` gives the prompt cache a disk tier
(``prompt_cache_disk``): the entries memory stored are queued once no
request has come for 0.1 s (``spill_idle``: a put made the entry's state
on the generation thread, which the next request of an agent loop waited
for), those memory evicted meanwhile first, then the newest first of those
it still holds, and
written to DIR by a background thread (``--prompt-cache-queue-bytes``,
default 1G, bounds the queue; what does not fit is not written, and the
log counts it), read back where memory has less of a prompt, and found
again after a restart, also after kill -9. Stopped with SIGTERM (systemd,
docker, Kubernetes; upstream dies at once and keeps nothing) or Ctrl-C,
the server writes the queue and what memory holds for at most
``DiskPromptCache.drain_seconds`` (10 s), then exits 0 (a second SIGTERM
while it writes ends it at once: ``server_http``).
``--prompt-cache-disk-bytes`` (default 16G) bounds DIR;
``--prompt-cache-disk-block`` (default 1024) is the tokens a block file holds
(entries share the block files of a common prefix; 375 files of 64 tokens
made a 24k-token restore slower than its prefill on an H200). Its files hold the
keys and values of users' prompts: written ``0600``, a directory made
``0700`` (``--prompt-cache-mode``, for replicas of one group: ``660``;
before, ``os.open`` without a mode made them ``0755``). At start the
log gives the disk entries found (count, bytes) and the budgets in force;
then both tiers' sizes before each request and which tier served how many
of its tokens. Upstream's ``main`` builds its parser inline; an edit of it
adds the flags, their types in the new module ``mlx_lm/server_prompt_cache.py``
(with the timings logged). Its size flags took upstream's ``_parse_size``,
whose ``-1``, ``abc`` and ``10K`` end in a traceback: ``parse_byte_size``
takes ``4096``, ``10K``, ``4M``, ``2G``, ``1T`` (and ``KiB``... in powers of
1024) or gives argparse's one-line error, as ``--prompt-cache-dir`` does for
a file or a directory it cannot list (``prompt_cache_dir``).
``--listen-backlog``, ``--max-connections`` and ``--idle-timeout`` size the
HTTP server for bursts (``server_http``).

``_tokenize`` rendered and encoded the whole conversation for every request,
and its system prompt again to find where that ends: an agent loop resends
both every turn, so a hit paid for tokens made before (a 24k-token prompt
again: ~50 ms on an H200's host). Both calls go through ``_chat_tokens``,
which keeps the last ``chat_tokens_kept`` calls' tokens, and encodes a
grown conversation from the last special token it shares with a kept one
(``encode_resumed``: a tokenizer encodes the text between added tokens
apart, so the tokens are the same): an agent's 8k-token turn encoded 12 ms
of text made before.
"""

from typing import TYPE_CHECKING

from .._newmods import hooks, new_module
from .._registry import Patch, edits, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    import json
    import logging

    from mlx_lm.server_prompt_cache import cache_size, encode_resumed, resumable


class ResponseGenerator:
    def _chat_tokens(self, tokenizer, messages, **kwargs):
        """``tokenizer.apply_chat_template(messages, **kwargs)``, the last
        ``chat_tokens_kept`` calls' tokens kept: agent and chat loops resend
        a conversation, and ``_tokenize`` its system prompt, every request.
        A new conversation's text is encoded from the last special token it
        shares with a kept one (``encode_resumed``). Not kept: inputs that
        are not JSON, templates that read the clock."""
        template = str(getattr(tokenizer, "chat_template", None) or "")
        try:
            key = json.dumps([messages, kwargs], sort_keys=True)
        except (TypeError, ValueError):
            key = None
        if key is None or "strftime_now" in template:
            return tokenizer.apply_chat_template(messages, **kwargs)
        owner, kept, encoder = getattr(self, "_chat_tokens_kept", (None,) * 3)
        if owner is not tokenizer:
            kept, encoder = {}, resumable(tokenizer)
            self._chat_tokens_kept = (tokenizer, kept, encoder)
        entry = kept.pop(key, None)
        if entry is None and (encoder is None or not kwargs.get("tokenize")):
            tokens = tokenizer.apply_chat_template(messages, **kwargs)
            if not isinstance(tokens, list):
                return tokens
            entry = (None, tokens, None)
        elif entry is None:
            text = tokenizer.apply_chat_template(
                messages, **{**kwargs, "tokenize": False}
            )
            known = [e for e in kept.values() if e[0] is not None]
            entry = (text, *encode_resumed(encoder, text, known))
        kept[key] = entry
        while len(kept) > self.chat_tokens_kept:
            del kept[next(iter(kept))]
        return list(entry[1])

    chat_tokens_kept = 8

    def _log_cache_stats(self):
        logging.info(f"Prompt Cache: {cache_size(self.prompt_cache)}")
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


# ResponseGenerator._generate: the budget after every batch step, each
# request's timings, the disk tier's prefill counters, its segments' caches
# stored after its first token with text.
_GENERATE = """\
@@ -23,2 +23,19 @@
             return self._next_request(timeout)
 
+    def hold_prompt_cache_bytes():
+        # The prompt cache and the running batch within --prompt-cache-bytes
+        if self.model_provider.cli_args.prompt_cache_bytes is not None:
+            total = self.model_provider.cli_args.prompt_cache_bytes
+            active = batch_generator.prompt_cache_nbytes
+            self.prompt_cache.trim_to(n_bytes=total - active)
+
+    def store_segments(result):
+        # A request's segment caches, stored once its first text is out
+        for key, tokens, cache, cache_type in result.pop("segments", ()):
+            at = time.perf_counter()
+            self.prompt_cache.insert_cache(key, tokens, cache, cache_type=cache_type)
+            timing = result["timing"]
+            timing["segments"] = timing.get("segments", 0.0) + (
+                time.perf_counter() - at
+            )
+
@@ -37,2 +54,9 @@
             request = get_next_request(timeout=timeout)
+            if request is None and not batch_results:
+                # Idle 0.1 s: what memory keeps whole rests, the disk tier
+                # queues what memory took since
+                if self.prompt_cache.rest():
+                    size = cache_size(self.prompt_cache)
+                    logging.info(f"Prompt cache at rest: {size}")
+                if hasattr(self.prompt_cache, "spill_idle"):
+                    self.prompt_cache.spill_idle()
 
@@ -53,2 +77,3 @@
             ):
+                timing = {"start": time.perf_counter()}
                 try:
@@ -56,4 +81,5 @@
                         self._tokenize(current_tokenizer, request, args)
                     )
+                    timing["tokenize"] = time.perf_counter()
                 except Exception as e:
                     rqueue.put(e)
@@ -68,2 +94,3 @@
                 self._log_cache_stats()
+                timing["prepare"] = time.perf_counter()
                 cache, rest = self.prompt_cache.fetch_nearest_cache(
@@ -71,2 +98,11 @@
                 )
+                timing["fetch"] = time.perf_counter()
+                if cache is None:  # rings with the server's slack, checkpoints
+                    cache = make_prompt_cache(
+                        self.model_provider.model,
+                        getattr(self.cli_args, "max_kv_size", None),
+                        getattr(self.cli_args, "prompt_cache_slack", 0),
+                        getattr(self.cli_args, "prompt_cache_checkpoint_every", 0),
+                    )
+                timing["make"] = time.perf_counter()
                 prompt_cache_count = len(prompt) - len(rest)
@@ -107,3 +143,5 @@
                     "top_logprobs": args.top_logprobs,
+                    "timing": timing,
                 }
+                timing["insert"] = time.perf_counter()
                 # just making sure we don't leave a reference around
@@ -111,6 +149,3 @@
 
-                if self.model_provider.cli_args.prompt_cache_bytes is not None:
-                    total = self.model_provider.cli_args.prompt_cache_bytes
-                    active = batch_generator.prompt_cache_nbytes
-                    self.prompt_cache.trim_to(n_bytes=total - active)
+                hold_prompt_cache_bytes()
                 continue
@@ -147,2 +182,5 @@
                 )
+                # The disk tier's cost model reads how fast it prefills.
+                if hasattr(self.prompt_cache, "prefill_counters"):
+                    self.prompt_cache.prefill_counters = batch_generator._counters
                 unprocessed_requests.append((rqueue, request, args))
@@ -192,7 +230,10 @@
                 for uid, (cache, cache_key) in caches.items():
-                    self.prompt_cache.insert_cache(
-                        self.model_provider.model_key,
-                        cache_key[:],
-                        cache,
-                        cache_type=batch_results[uid]["segment_types"].pop(),
+                    # Stored after the first text: the prompt goes on first
+                    batch_results[uid].setdefault("segments", []).append(
+                        (
+                            self.model_provider.model_key,
+                            cache_key[:],
+                            cache,
+                            batch_results[uid]["segment_types"].pop(),
+                        )
                     )
@@ -202,2 +243,3 @@
                     result = batch_results[r.uid]
+                    log_timing(result["timing"], "first_token")
 
@@ -228,2 +270,6 @@
                     )
+                    if text or r.finish_reason is not None:
+                        # Once the client has text: a first token without
+                        # any waits for the next step, which they would delay
+                        store_segments(result)
 
@@ -231,2 +274,3 @@
                         result["rqueue"].put(None)
+                        result["timing"]["done"] = time.perf_counter()
                         self.prompt_cache.insert_cache(
@@ -237,2 +281,3 @@
                         )
+                        log_timing(result["timing"], "store")
                         del batch_results[r.uid]
@@ -240,4 +285,6 @@
                     if result["ctx"]._should_stop:
                         uids_to_remove.append(r.uid)
 
+                hold_prompt_cache_bytes()
+
             uids_to_remove = self._share_object(uids_to_remove)
@@ -248,3 +295,6 @@
                     # generation
-                    batch_results.pop(uid, None)
+                    store_segments(batch_results.pop(uid, {}))
 
+    for result in batch_results.values():  # stopped: their segments kept
+        store_segments(result)
+
"""


# ResponseGenerator._tokenize: the conversation's and the system prompt's
# tokens through _chat_tokens.
_TOKENIZE = """\
@@ -60,2 +60,3 @@
-                prompt = tokenizer.apply_chat_template(
+                prompt = self._chat_tokens(
+                    tokenizer,
                     messages,
@@ -101,2 +102,3 @@
-        sys_tokens = tokenizer.apply_chat_template(
+        sys_tokens = self._chat_tokens(
+            tokenizer,
             messages[:num_system] + [{"role": "user", "content": ""}],
"""


# main: the prompt cache's flags.
_MAIN = """\
@@ -1,3 +1,7 @@
 def main():
-    parser = argparse.ArgumentParser(description="MLX Http Server.")
+    parser = argparse.ArgumentParser(
+        description="%(prog)s: an OpenAI-compatible HTTP server for MLX models "
+        "(mlx-lm's, with mlx-lm-patched's caches): batched requests, a prompt "
+        "cache in memory and, with --prompt-cache-dir, on disk."
+    )
     parser.add_argument(
@@ -33,3 +37,5 @@
         type=str,
-        help="A model to be used for speculative decoding.",
+        help="A model to be used for speculative decoding (requests are then "
+        "served one at a time); works with --max-kv-size and sliding-window "
+        "models",
         default=None,
@@ -39,3 +45,4 @@
         type=int,
-        help="Number of tokens to draft when using speculative decoding.",
+        help="Number of tokens to draft when using speculative decoding "
+        "(default: 3)",
         default=3,
@@ -106,3 +113,4 @@
         default=32,
-        help="When a request is batchable then decode that many requests in parallel",
+        help="When a request is batchable then decode that many requests in "
+        "parallel (default: 32)",
     )
@@ -112,3 +120,4 @@
         default=8,
-        help="When a request is batchable then process that many prompts in parallel",
+        help="When a request is batchable then process that many prompts in "
+        "parallel (default: 8)",
     )
@@ -124,3 +133,4 @@
         default=10,
-        help="Maximum number of distinct KV caches to hold in the prompt cache",
+        help="Maximum number of distinct KV caches to hold in the prompt "
+        "cache in memory (default: 10)",
     )
@@ -128,4 +138,70 @@
         "--prompt-cache-bytes",
-        type=_parse_size,
-        help="Maximum size in bytes of the KV caches",
+        type=parse_byte_size,
+        help="Maximum size of the prompt cache in memory plus the running "
+        "batch's caches, held after every insert and batch step: bytes, or "
+        "with a unit: 500M, 2G, 1.5G, 4GiB (default: no limit)",
     )
+    parser.add_argument(
+        "--prompt-cache-dir",
+        help="Directory for a disk tier of the prompt cache (made if missing): "
+        "every entry is written there as it is made, by a background thread, "
+        "served from there where memory holds less of a prompt, and found "
+        "again after a restart (default: none, memory only)",
+    )
+    parser.add_argument(
+        "--prompt-cache-disk-bytes",
+        type=parse_byte_size,
+        default="16G",
+        help="Maximum size of the --prompt-cache-dir files, oldest removed "
+        "first: bytes, or 500M, 16G... (default: 16G)",
+    )
+    parser.add_argument(
+        "--prompt-cache-disk-block",
+        type=int,
+        default=1024,
+        help="Tokens a block file of --prompt-cache-dir holds: entries share "
+        "the block files of the prefix they have in common; larger files "
+        "restore faster, smaller ones share more (default: 1024)",
+    )
+    parser.add_argument(
+        "--prompt-cache-queue-bytes",
+        type=parse_byte_size,
+        default="1G",
+        help="Maximum size of the prompt caches waiting to be written "
+        "to --prompt-cache-dir; more are not written, and the log counts "
+        "them (default: 1G)",
+    )
+    parser.add_argument(
+        "--prompt-cache-mode",
+        type=file_mode,
+        default="600",
+        help="Permissions of the files written to --prompt-cache-dir, in "
+        "octal, less the umask; a directory made gets x where they have r. "
+        "The files hold the keys and values of users' prompts: the default "
+        "is the owner only (default: 600, directories 700); replicas running "
+        "as users of one group share a directory with 660 (and umask 007)",
+    )
+    parser.add_argument(
+        "--prompt-cache-bits",
+        type=int,
+        choices=[4, 8],
+        help="Keep prompt cache entries quantized to 4 or 8 bits at rest, in "
+        "memory and on disk (the last request's once the next one took "
+        "them); requests still compute at their own precision (default: "
+        "none, entries as the requests' caches)",
+    )
+    parser.add_argument(
+        "--prompt-cache-group-size",
+        type=int,
+        choices=[32, 64, 128],
+        default=64,
+        help="Group size of --prompt-cache-bits (default: 64)",
+    )
+    # A chat template's re-rendered tail (an end-of-turn marker, a stripped
+    # space, a changed last word) is a few tokens.
+    parser.add_argument(
+        "--prompt-cache-slack",
+        type=int,
+        default=8,
+        help="Tokens a rotating cache layer (a sliding window, a --max-kv-size "
+        "ring) can be trimmed back after it wraps, so a chat whose client "
+        "re-renders the end of the previous answer reuses its cache; at most "
+        "the window (default: 8)",
+    )
+    # At most 8 (``max_checkpoints``), spread over 24,576 tokens (``_spread``).
+    parser.add_argument(
+        "--prompt-cache-checkpoint-every",
+        type=int,
+        default=512,
+        help="Rotating cache layers keep a copy of their window every this many "
+        "tokens of a prompt (at most 8, spread over it), so a request that "
+        "branches off a cached prompt, even far back, prefills from the nearest "
+        "one; 0: none (default: 512)",
+    )
+    parser.add_argument(
+        "--max-kv-size",
+        type=int,
+        help="Tokens of cache a layer keeps for each conversation: "
+        "full-attention layers become rings of this many tokens that keep the "
+        "first 4 (RotatingKVCache(N, keep=4)), sliding-window layers a window "
+        "no larger; the prompt cache holds the rings (default: none, "
+        "unbounded)",
+    )
@@ -135,5 +211,5 @@
         default=None,
-        help="Number of bits for KV cache quantization (e.g., 4 or 8). "
-        "Reduces memory usage for long contexts. Disables batching, so "
-        "requests are served one at a time. Default: None (full precision)",
+        help="Bits of the quantized KV cache: 2, 3, 4, 5, 6 or 8, from "
+        "--quantized-kv-start on; every cache, rings included; requests are "
+        "still batched (default: none, full precision)",
     )
@@ -149,3 +225,4 @@
         default=DEFAULT_QUANTIZED_KV_START,
-        help="Token position to start KV cache quantization "
+        help="With --kv-bits, quantize a cache once it holds this many "
+        "tokens; 0 quantizes from the first token "
         f"(default: {DEFAULT_QUANTIZED_KV_START})",
@@ -157,3 +234,39 @@
+    )
+    parser.add_argument(
+        "--listen-backlog",
+        type=int,
+        default=1024,
+        help="Connections the kernel holds until the server accepts them "
+        "(default: 1024)",
+    )
+    parser.add_argument(
+        "--max-connections",
+        type=int,
+        default=256,
+        help="Connections served at once, each by a thread; more get a 503 "
+        "(default: 256)",
+    )
+    parser.add_argument(
+        "--idle-timeout",
+        type=float,
+        default=60.0,
+        help="Seconds a connection may send nothing before it is closed "
+        "(default: 60)",
     )
     args = parser.parse_args()
+    if args.max_kv_size is not None and args.max_kv_size < 1:
+        parser.error(f"--max-kv-size must be >= 1, got {args.max_kv_size}")
+    for flag in (
+        "listen_backlog",
+        "max_connections",
+        "idle_timeout",
+        "prompt_cache_disk_block",
+    ):
+        if not getattr(args, flag) > 0:
+            parser.error(f"--{flag.replace('_', '-')} must be positive")
+    if args.prompt_cache_dir is not None:
+        try:  # made with the mode, known only now
+            prompt_cache_dir(args.prompt_cache_dir, args.prompt_cache_mode)
+        except argparse.ArgumentTypeError as e:
+            parser.error(f"argument --prompt-cache-dir: {e}")
     _ = maybe_set_recommended_wired_limit()
"""


# run: the prompt cache built with its byte budget, bits and disk tier.
_RUN = """\
@@ -8,4 +8,61 @@
     group = mx.distributed.init()
-    prompt_cache = LRUPromptCache(model_provider.cli_args.prompt_cache_size)
+    cli_args = model_provider.cli_args
+    # Entries quantized at rest (RAM and disk); the batch computes at its own.
+    at_rest = {
+        "bits": getattr(cli_args, "prompt_cache_bits", None),
+        "group_size": getattr(cli_args, "prompt_cache_group_size", 64),
+    }
+    if cli_args.prompt_cache_dir is None:
+        prompt_cache = LRUPromptCache(cli_args.prompt_cache_size, **at_rest)
+    else:
+        from .models.prompt_cache_disk import DiskLRUPromptCache, DiskPromptCache
+
+        # One directory per rank: each holds its own shard of the caches.
+        directory = Path(cli_args.prompt_cache_dir)
+        if group.size() > 1:
+            directory = directory / f"rank{group.rank()}"
+        disk = DiskPromptCache(
+            str(directory),
+            cli_args.prompt_cache_disk_bytes,
+            cli_args.prompt_cache_queue_bytes,
+            getattr(cli_args, "prompt_cache_mode", 0o600),
+            digest_wait=False,
+            block_tokens=getattr(cli_args, "prompt_cache_disk_block", 1024),
+        )
+        # Caches quantized otherwise are other entries: never served across.
+        disk.scope = " ".join(
+            f"--{k} {getattr(cli_args, k.replace('-', '_'), None)}"
+            for k in (
+                "kv-bits",
+                "kv-group-size",
+                "prompt-cache-bits",
+                "prompt-cache-group-size",
+            )
+        )
+        prompt_cache = DiskLRUPromptCache(disk, cli_args.prompt_cache_size, **at_rest)
+        # Queued for the disk while no request waits (_generate: spill_idle)
+        prompt_cache.spill_at_once = False
+        # The weights' digest (entries' model key) is read on a thread from
+        # now, not by the first request (an 8B model's 16 GB: 14 s on an
+        # H200's host); requests miss the disk tier until it is known.
+        default = ("model", "adapter_path", "draft_model")
+        disk._model_key(tuple(getattr(cli_args, k, None) for k in default), wait=False)
+    if cli_args.prompt_cache_bytes is not None:
+        prompt_cache.max_bytes = cli_args.prompt_cache_bytes
+    # What the server starts with, and the budgets it holds.
+    held = f"{cli_args.prompt_cache_size} entries"
+    if cli_args.prompt_cache_bytes is not None:
+        held += f", {cli_args.prompt_cache_bytes} B with the running batch"
+    line = f"Prompt cache: memory holds at most {held}"
+    if cli_args.prompt_cache_dir is not None:
+        line += (
+            f"; disk: {len(disk)} entries ({disk.nbytes} B) found in "
+            f"{directory}, holds at most {disk.max_bytes} B, queues at most "
+            f"{disk.queue_bytes} B"
+        )
+    if getattr(cli_args, "max_kv_size", None) is not None:
+        line += f"; caches are rings of {cli_args.max_kv_size} tokens"
+    logging.info(line)
     response_generator = ResponseGenerator(model_provider, prompt_cache)
+    # Stopped by SIGTERM as on Ctrl-C (server_http).
     if group.rank() == 0:
@@ -14,1 +71,23 @@
         response_generator.join()
+    if cli_args.prompt_cache_dir is not None:
+        # Stopped: what is queued, evicted and what memory holds are written,
+        # in a bounded time (memory's only once the generation thread is done
+        # with it: its entries are queued when it idles).
+        if not response_generator._generation_thread.is_alive():
+            prompt_cache.spill_idle()
+            prompt_cache.spill_at_once = True
+            prompt_cache.trim_to(n_sequences=0)
+        queued, *before = disk.tally()
+        logging.info(
+            f"Prompt cache: writing {queued} entries "
+            f"({disk.queued_bytes} B) to {directory}, for at most "
+            f"{disk.drain_seconds} s"
+        )
+        start = time.perf_counter()
+        left = disk.close(timeout=disk.drain_seconds)
+        written, dropped = (n - b for n, b in zip(disk.tally()[1:], before))
+        logging.info(
+            f"Prompt cache: written {written} entries in "
+            f"{time.perf_counter() - start:.2f} s"
+            + (f", {dropped} not written (warned)" if dropped else "")
+            + (f", {left} entries left unwritten" if left else "")
+        )
"""


PATCH = Patch(
    "server_prompt_cache",
    "server: --prompt-cache-bytes holds on every insert and after every batch "
    "step; --prompt-cache-dir writes prompt caches to disk when the server "
    "idles, "
    "drained on SIGTERM and Ctrl-C; the log shows both tiers; "
    "--prompt-cache-bits keeps them quantized at rest; files 0600 "
    "(--prompt-cache-mode); a start-up line with the entries found and the "
    "budgets; bad sizes and "
    "directories are one-line errors; a conversation resent is not tokenized "
    "again, a grown one only from its last shared special token",
    new_module("mlx_lm.server_prompt_cache")
    + hooks(
        "mlx_lm.server",
        "mlx_lm.server_prompt_cache",
        "cache_size",
        "common_prefix",
        "file_mode",
        "parse_byte_size",
        "prompt_cache_dir",
        "log_timing",
        "resumable",
        "encode_resumed",
    )
    + targets("mlx_lm.server:ResponseGenerator", ResponseGenerator)
    + edits("mlx_lm.server:ResponseGenerator", _generate=_GENERATE, _tokenize=_TOKENIZE)
    + edits("mlx_lm.server", run=_RUN, main=_MAIN),
    requires=(
        "mlx_lm.models.cache:LRUPromptCache.trim_to",
        "mlx_lm.models.cache:LRUPromptCache.rest",
        "mlx_lm.models:prompt_cache_disk",
        "mlx_lm.models.cache:make_prompt_cache",  # slack, checkpoint_every
    ),
)
