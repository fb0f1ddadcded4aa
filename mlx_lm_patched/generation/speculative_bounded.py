"""Speculative decoding with a bounded cache: ``--draft-model`` with
``--max-kv-size`` and on sliding-window models.

Upstream's ``stream_generate`` drops ``max_kv_size`` whenever a draft model
is given (the cache grows without bound), and on a model with sliding
layers, once a ring wraps, ``speculative_generate_step``'s trims of the
rejected draft tokens silently do nothing (``trim_prompt_cache`` returns 0):
the rejected tokens stay in the ring and the output drifts from the
no-draft output a few tokens after the wrap. Here ``stream_generate`` builds
the model's and the draft's caches with ``max_kv_size`` and gives every
rotating layer ``slack`` for ``num_draft_tokens`` (``RotatingKVCache``
steps back that many tokens exactly after a wrap, see ``rotating_prealloc``);
a trim it still cannot do exactly returns 0 (``ring_trim_slack``). Greedy tokens equal
the no-draft run's with the same ``max_kv_size``, also with ``kv_bits``: the
quantized ring keeps the slack (``quantized_ring``).
"""

from .._registry import Patch, edits, targets


# Written as they read in mlx_lm/generate.py, and run there.
def _give_slack(prompt_cache, num_draft_tokens):
    """Let every rotating layer step back ``num_draft_tokens`` after a wrap
    (``kv_bits`` quantizes a ring into one that keeps the slack)."""
    for c in prompt_cache:
        if hasattr(c, "slack") and c.slack < num_draft_tokens:
            if num_draft_tokens > c.max_size - c.keep:
                raise ValueError(
                    f"num_draft_tokens {num_draft_tokens} does not fit a rotating "
                    f"cache of {c.max_size} tokens (keep {c.keep})"
                )
            c.slack = num_draft_tokens


# stream_generate: a draft model keeps max_kv_size, its rings given slack.
_STREAM_GENERATE = """\
@@ -58,3 +58,3 @@
     else:
-        kwargs.pop("max_kv_size", None)
+        max_kv_size = kwargs.pop("max_kv_size", None)
         kwargs.pop("prompt_progress_callback", None)
@@ -62,2 +62,9 @@
             raise ValueError("Speculative decoding does not support input embeddings.")
+        if kwargs.get("prompt_cache") is None:
+            kwargs["prompt_cache"] = make_prompt_cache(
+                model, max_kv_size
+            ) + make_prompt_cache(draft_model, max_kv_size)
+        # speculative_generate_step's default: 2 draft tokens.
+        num_draft_tokens = kwargs.get("num_draft_tokens", 2)
+        _give_slack(kwargs["prompt_cache"], num_draft_tokens)
         token_generator = speculative_generate_step(
@@ -65,2 +72,17 @@
         )
+
+    def response(finish_reason=None):
+        return GenerationResponse(
+            text=detokenizer.last_segment,
+            token=token,
+            logprobs=logprobs,
+            from_draft=from_draft,
+            prompt_tokens=prompt.size,
+            prompt_tps=prompt_tps,
+            generation_tokens=n + 1,
+            generation_tps=(n + 1) / (time.perf_counter() - tic),
+            peak_memory=mx.get_peak_memory() / 1e9,
+            finish_reason=finish_reason,
+        )
+
     with wired_limit(model, [stream]):
@@ -79,27 +101,5 @@
 
-            yield GenerationResponse(
-                text=detokenizer.last_segment,
-                token=token,
-                logprobs=logprobs,
-                from_draft=from_draft,
-                prompt_tokens=prompt.size,
-                prompt_tps=prompt_tps,
-                generation_tokens=n + 1,
-                generation_tps=(n + 1) / (time.perf_counter() - tic),
-                peak_memory=mx.get_peak_memory() / 1e9,
-                finish_reason=None,
-            )
+            yield response()
 
         detokenizer.finalize()
-        yield GenerationResponse(
-            text=detokenizer.last_segment,
-            token=token,
-            logprobs=logprobs,
-            from_draft=from_draft,
-            prompt_tokens=prompt.size,
-            prompt_tps=prompt_tps,
-            generation_tokens=n + 1,
-            generation_tps=(n + 1) / (time.perf_counter() - tic),
-            peak_memory=mx.get_peak_memory() / 1e9,
-            finish_reason="stop" if token in tokenizer.eos_token_ids else "length",
-        )
+        yield response("stop" if token in tokenizer.eos_token_ids else "length")
"""


PATCH = Patch(
    "speculative_bounded",
    "stream_generate: --draft-model keeps --max-kv-size; rotating layers get "
    "slack for the rejected draft tokens",
    targets("mlx_lm.generate", _give_slack)
    + edits("mlx_lm.generate", stream_generate=_STREAM_GENERATE),
    requires=(
        "mlx_lm.models.cache:RotatingKVCache.trimmable_tokens",
        "mlx_lm.models.cache:trim_prompt_cache",
    ),
)
