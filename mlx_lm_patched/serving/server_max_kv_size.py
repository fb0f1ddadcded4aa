"""``mlx_lm.server --max-kv-size N`` bounds every conversation's cache.

Upstream's server has no ``--max-kv-size`` (``generate`` has): a long
conversation's cache grows with it, and so does every prompt cache entry
(ml-explore/mlx-lm#126 asks for it). Here the server takes the flag
(``server_prompt_cache``'s parser) and every cache it makes is
``make_prompt_cache(model, max_kv_size)``: full-attention layers are rings
of N tokens keeping the first 4, sliding layers keep a window no larger
(``max_kv_size``). Requests served one at a time (a seed, images, a draft
model) get them from ``_serve_single`` here, batched ones from
``BatchGenerator(max_kv_size=...)`` (in ``_generate``).
The prompt cache, ``--kv-bits`` (quantized rings), ``--prompt-cache-bits``
and ``--prompt-cache-dir`` take the rings as they take a sliding-window
model's.
"""

from .._registry import Patch, edits

# ResponseGenerator._generate: the batched requests' caches bounded too.
_GENERATE = """\
@@ -165,2 +165,3 @@
                     stream=generation_stream,
+                    max_kv_size=getattr(self.cli_args, "max_kv_size", None),
                     kv_bits=self.cli_args.kv_bits,
"""


# ResponseGenerator._serve_single: its caches bounded by --max-kv-size.
_SERVE_SINGLE = """\
@@ -51,5 +51,12 @@
-        if cache is None:
-            cache = make_prompt_cache(self.model_provider.model)
+        if cache is None:  # with the server's ring slack and checkpoints
+            options = (
+                getattr(self.cli_args, "max_kv_size", None),
+                getattr(self.cli_args, "prompt_cache_slack", 0),
+                getattr(self.cli_args, "prompt_cache_checkpoint_every", 0),
+            )
+            cache = make_prompt_cache(self.model_provider.model, *options)
             if self.model_provider.draft_model is not None:
-                cache += make_prompt_cache(self.model_provider.draft_model)
+                cache += make_prompt_cache(self.model_provider.draft_model, *options)
 
"""


PATCH = Patch(
    "server_max_kv_size",
    "server: --max-kv-size N makes every conversation's cache a ring of N tokens",
    edits(
        "mlx_lm.server:ResponseGenerator",
        _serve_single=_SERVE_SINGLE,
        _generate=_GENERATE,
    ),
    requires=(
        "mlx_lm.models.cache:_bound_layers",
        "mlx_lm.models.cache:make_prompt_cache",  # slack, checkpoint_every
    ),
)
