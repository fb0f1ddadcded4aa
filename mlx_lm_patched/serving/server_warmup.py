"""The server serves made-up tokens once before its first request.

A fresh server process builds (or loads from MLX's cache on disk) the
kernels of each path the first time a request takes it, and that request
waits: on an H200 a Gemma-3 hit's first step took 57 ms more the first time
(kernels on disk) and 1.8-2.1 s more on a machine that had never built them
(``docs/serving.md``). Once the default model is loaded, ``_generate`` runs
``_warm_up``: ``--warmup-tokens`` made-up tokens (default: the longest
window of the model's caches plus 256, at most 4,352) through a
``BatchGenerator`` made as the server's and a prompt cache of its kind
(quantized at rest where the server's is), in two segments, then the same
prompt again (a hit) and once more with 64 tokens added (a hit that
prefills), two tokens generated each time. Its caches are dropped: the
server's prompt cache and disk tier never see them. Then, if the disk tier
(``--prompt-cache-dir``) never measured a restore, it restores one entry
and drops it (``probe_read``): the first hit after a restart is chosen by
what a read takes on this machine, not by a prior. ``--warmup-tokens 0``
turns it off; a warm-up that fails is logged and the server serves on.
"""

import logging
import time
from typing import TYPE_CHECKING

from .._registry import Patch, edits, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache


# Written as it reads in mlx_lm/server.py, and runs there.
def _serve_once(generator, store, tokens, model, options):
    """One made-up request served as ``_generate`` serves one: its prefix
    from ``store`` (else new caches of ``options``), its segment's end and
    its answer stored there."""
    cache, rest = store.fetch_nearest_cache("warm-up", tokens)
    generator.insert_segments(
        [[rest[:-1], rest[-1:]] if len(rest) > 1 else [rest]],
        max_tokens=[2],
        caches=[cache or make_prompt_cache(model, *options)],
        all_tokens=[tokens[: len(tokens) - len(rest)]],
    )
    while True:
        prompt_responses, responses = generator.next()
        ends = [
            r.uid for r in prompt_responses if r.end_of_segment and not r.end_of_prompt
        ]
        for segment, key in generator.extract_cache(ends).values():
            store.insert_cache("warm-up", key[:], segment)
        for r in responses:
            if r.finish_reason is not None:
                store.insert_cache("warm-up", r.all_tokens[:], r.prompt_cache)
                return


class ResponseGenerator:
    def _warm_up(self, stream):
        """Serve made-up tokens the way requests are served, in a prompt
        cache of their own, so that the first requests find the kernels."""
        model, args = self.model_provider.model, self.cli_args
        if model is None or not self.model_provider.is_batchable:
            return
        options = (
            getattr(args, "max_kv_size", None),
            getattr(args, "prompt_cache_slack", 0),
            getattr(args, "prompt_cache_checkpoint_every", 0),
        )
        n = getattr(args, "warmup_tokens", None)
        if n is None:
            sizes = [
                getattr(c, "max_size", 0) or 0
                for c in make_prompt_cache(model, *options)
            ]
            n = min(max(sizes, default=0), 4096) + 256
        if n <= 0:
            return
        start = time.perf_counter()
        prompt = [1 + i % 97 for i in range(n)]
        store = LRUPromptCache(
            2,
            bits=getattr(args, "prompt_cache_bits", None),
            group_size=getattr(args, "prompt_cache_group_size", 64),
        )
        try:
            generator = BatchGenerator(
                model,
                prefill_step_size=args.prefill_step_size,
                stream=stream,
                max_kv_size=options[0],
                kv_bits=args.kv_bits,
                kv_group_size=args.kv_group_size,
                quantized_kv_start=args.quantized_kv_start,
            )
            try:
                for tokens in (prompt, prompt, prompt + prompt[:64]):
                    _serve_once(generator, store, tokens, model, options)
            finally:
                generator.close()
            seconds = time.perf_counter() - start
            disk = getattr(self.prompt_cache, "disk", None)
            probed = disk is not None and disk.probe_read()
        except Exception as e:
            logging.warning(f"Warm-up failed, serving without it: {e!r}")
            return
        logging.info(f"Warm-up: {n} made-up tokens served in {seconds:.2f} s")
        if probed:
            read, took = disk.last_read
            logging.info(
                f"Warm-up: the prompt cache's disk tier read {read} B in {took:.2f} s"
            )


# ResponseGenerator._generate: the warm-up once the default model is loaded.
_GENERATE = """\
@@ -8,1 +8,2 @@
     self.model_provider.load_default()
+    self._warm_up(generation_stream)
"""


# main: --warmup-tokens.
_MAIN = """\
@@ -1,3 +1,12 @@
         "(default: 60)",
     )
+    parser.add_argument(
+        "--warmup-tokens",
+        type=int,
+        default=None,
+        help="Made-up tokens the server serves once at start, so that the "
+        "first requests find MLX's kernels built; 0: none (default: the "
+        "longest window of the model's caches plus 256, at most 4352)",
+    )
     args = parser.parse_args()
+    if args.warmup_tokens is not None and args.warmup_tokens < 0:
+        parser.error(f"--warmup-tokens must be >= 0, got {args.warmup_tokens}")
"""


PATCH = Patch(
    "server_warmup",
    "server: made-up tokens served once at start, so that the first requests "
    "find MLX's kernels built",
    targets("mlx_lm.server", _serve_once)
    + targets("mlx_lm.server:ResponseGenerator", ResponseGenerator)
    + edits("mlx_lm.server:ResponseGenerator", _generate=_GENERATE)
    + edits("mlx_lm.server", main=_MAIN),
)
