"""The server reads a token's logprob only for a request that asks for it.

A decode step encodes the next step (``mx.async_eval``) before it hands out
the tokens of the one before, so the GPU computes a step while the host
serves the last one. Upstream's server then reads every token's logprob
(``logprobs[token].item()``), which its HTTP handler sends only where the
request asked for ``logprobs``: a read is a new op, queued behind the step
just encoded, so every decode step of every request waited for the next
one on the GPU before the host went on. On an H200, 8 agent loops decoding
together spent 16 ms a step outside ``BatchGenerator.next`` against 9 ms in
it, on both servers (``docs/serving.md``). Here a request without
``logprobs`` gets None in that place, which nothing reads; one with them
gets the same values as before.
"""

from .._registry import Patch, edits

# ResponseGenerator._generate: a batched request's token logprob.
_GENERATE = """\
@@ -173,2 +173,3 @@
                     "top_logprobs": args.top_logprobs,
+                    "logprobs": args.logprobs,
                     "errors": errors,
@@ -306,3 +307,8 @@
                             r.token,
-                            r.logprobs[r.token].item(),
+                            # read (a wait for the GPU) where it is asked for
+                            (
+                                r.logprobs[r.token].item()
+                                if result["logprobs"]
+                                else None
+                            ),
                             r.finish_reason,
"""

# ResponseGenerator._serve_single: the same, a request served alone.
_SERVE_SINGLE = """\
@@ -102,3 +102,3 @@
                     gen.token,
-                    gen.logprobs[gen.token].item(),
+                    gen.logprobs[gen.token].item() if args.logprobs else None,
                     finish_reason,
"""


PATCH = Patch(
    "server_token_logprob",
    "server: a token's logprob is read (a wait for the GPU's next step) only "
    "for a request that asks for logprobs",
    edits(
        "mlx_lm.server:ResponseGenerator",
        _generate=_GENERATE,
        _serve_single=_SERVE_SINGLE,
    ),
)
