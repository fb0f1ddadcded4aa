"""The server keeps batching with ``--kv-bits``.

Upstream's server serves every request one at a time once ``--kv-bits`` is
given (``_is_batchable``), because ``BatchGenerator`` had no ``kv_bits``.
With ``batch_generator_kv_bits`` it has: requests are batched as without
``--kv-bits``, and ``_generate`` hands the server's ``--kv-bits``,
``--kv-group-size`` and ``--quantized-kv-start`` to its ``BatchGenerator``.
"""

from .._registry import Patch, edits

# Written against mlx_lm/server.py's ResponseGenerator, and run there.
_IS_BATCHABLE = """\
@@ -1,6 +1,2 @@
 def _is_batchable(self, args):
-    return (
-        self.model_provider.is_batchable
-        and args.seed is None
-        and self.cli_args.kv_bits is None
-    )
+    return self.model_provider.is_batchable and args.seed is None
"""

_GENERATE = """\
@@ -143,2 +143,5 @@
                     stream=generation_stream,
+                    kv_bits=self.cli_args.kv_bits,
+                    kv_group_size=self.cli_args.kv_group_size,
+                    quantized_kv_start=self.cli_args.quantized_kv_start,
                 )
"""

PATCH = Patch(
    "server_kv_bits",
    "server: batch requests with --kv-bits, passing it to BatchGenerator",
    edits(
        "mlx_lm.server:ResponseGenerator",
        _is_batchable=_IS_BATCHABLE,
        _generate=_GENERATE,
    ),
    requires=("mlx_lm.generate:BatchGenerator.__init__",),  # kv_bits
)
