"""A failing request fails alone; a client that leaves cancels its request.

Upstream's generation thread ends at the first exception a request raises
outside ``_tokenize`` and ``_serve_single`` (a sampler that cannot take its
arguments, stop words it cannot match, a batch step): every later request
fails and /health is 503 until a restart (issue 25). Here ``_run_generate``
runs ``_generate`` again after a failure, failing only the requests the
thread had taken (``_next_request`` keeps them), so those clients get the
error and the requests still queued are served. A failure before any
request was taken (the model does not load) still ends the thread.

An exception from the generation after ``handle_completion`` has its
context dropped the connection with no status; here the client gets the
error (a 400 for a ``ValueError``, else 500; an SSE ``error`` event once a
stream has started). Non-stream replies send their status at the end.

A streaming request stops generating when a write to its client fails;
a non-stream one wrote nothing until the end, so one whose client left
generated to ``max_tokens`` (4 abandoned requests of 10**9 tokens held a
core and slowed everyone else 12x). ``handle_completion`` now looks at the
connection after every token and progress report of a non-stream request
(``_client_disconnected``: a poll, then a peek) and cancels as a stream does.
A request that cannot start because the server is stopping gets a 503.

A request whose sampler or logits processor raises in a batch step (a
``top_k`` or ``logit_bias`` id past the vocabulary) gets the error and
leaves the batch (``_failing_alone``, in ``_generate``); upstream's step
raised out of ``_generate`` and ended the thread with every request in it.
"""

import logging
import select
import weakref
from typing import TYPE_CHECKING

from .._registry import Patch, edits, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    import socket


# Written as it reads in mlx_lm/server.py, and runs there.
def _failing_alone(fn, errors, fallback):
    """``fn``, keeping what it raises in ``errors`` and answering as
    ``fallback`` instead: one request's sampler or logits processor fails
    that request, not the batch step."""

    def call(*args):
        try:
            return fn(*args)
        except Exception as e:
            errors.append(e)
            return fallback(*args)

    return call


class ResponseGenerator:
    def _run_generate(self):
        # The requests the generation thread took: failed if it fails.
        self._taken = weakref.WeakSet()
        while True:
            try:
                self._generate()
                return
            except Exception as e:
                if self._stop or not self._taken:
                    logging.exception(f"mlx_lm.server generation thread died: {e}")
                    self._generation_failed = True
                    return
                logging.exception(f"mlx_lm.server requests failed: {e}")
                for rqueue in list(self._taken):
                    rqueue.put(e)
                self._taken = weakref.WeakSet()


class APIHandler:
    def _client_disconnected(self):
        """Whether the client closed its end of the connection."""
        try:
            # Polled first: a socket with a timeout waits that long to recv.
            poll = select.poll()
            poll.register(self.connection, select.POLLIN)
            if not poll.poll(0):
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True


# ResponseGenerator._generate: a request's sampler or logits processor that
# raises in a batch step fails that request, not the step.
_GENERATE = """\
@@ -66,2 +66,19 @@
                     timing["tokenize"] = time.perf_counter()
+                    # server_failures: what a request's arguments raise,
+                    # here or in a batch step, fails that request alone.
+                    stop_sequences, text_sm = self._make_state_machine(
+                        self.model_provider.model_key,
+                        current_tokenizer,
+                        args.stop_words,
+                    )
+                    errors = []
+                    sampler = _failing_alone(
+                        _make_sampler(args, current_tokenizer),
+                        errors,
+                        lambda logprobs: mx.argmax(logprobs, axis=-1),
+                    )
+                    logits_processors = [
+                        _failing_alone(p, errors, lambda _, logits: logits)
+                        for p in _make_logits_processors(args)
+                    ]
                 except Exception as e:
@@ -69,8 +86,2 @@
                     continue
 
-                stop_sequences, text_sm = self._make_state_machine(
-                    self.model_provider.model_key,
-                    current_tokenizer,
-                    args.stop_words,
-                )
-
@@ -108,4 +119,4 @@
                     all_tokens=[prompt[:prompt_cache_count]],
-                    samplers=[_make_sampler(args, current_tokenizer)],
-                    logits_processors=[_make_logits_processors(args)],
+                    samplers=[sampler],
+                    logits_processors=[logits_processors],
                     stop_sequences=[stop_sequences],
@@ -118,2 +129,3 @@
                     "top_logprobs": args.top_logprobs,
+                    "errors": errors,
                     "timing": timing,
@@ -185,2 +197,8 @@
                 prompt_responses, gen_responses = batch_generator.next()
+                # server_failures: a request whose sampler or logits
+                # processor raised gets the error and leaves the batch.
+                for result in batch_results.values():
+                    if result["errors"] and not result["ctx"]._should_stop:
+                        result["rqueue"].put(result["errors"][0])
+                        result["ctx"].stop()
                 if not prompt_responses and not gen_responses:
"""


# APIHandler.handle_completion: the error to its client; a client gone cancels.
_HANDLE_COMPLETION = r"""@@ -48,2 +48,4 @@
             self.wfile.flush()
+        elif self._client_disconnected():
+            raise ConnectionAbortedError("client disconnected")
 
@@ -57,3 +59,6 @@
     except Exception as e:
-        self._set_completion_headers(404)
+        status = 400 if isinstance(e, ValueError) else 404
+        self._set_completion_headers(
+            503 if self.response_generator._stop else status
+        )
         self.end_headers()
@@ -68,3 +73,2 @@
     else:
-        self._set_completion_headers(200)
         logging.debug("Starting completion:")
@@ -145,2 +149,7 @@
+
+            # Nothing is written to a non-stream client before the end:
+            # look whether it is still there.
+            if not self.stream and self._client_disconnected():
+                raise ConnectionAbortedError("client disconnected")
 
         if prev_state == "tool" and tool_text:
@@ -192,2 +201,3 @@
             response_json = json.dumps(resp).encode()
+            self._set_completion_headers(200)
             self.send_header("Content-Length", str(len(response_json)))
@@ -196,2 +206,16 @@
             self.wfile.flush()
+    except ConnectionError:
+        logging.info("Request cancelled: client disconnected")
+    except Exception as e:
+        # The generation failed: the client gets an error, not a
+        # dropped connection.
+        logging.error(f"Request failed: {e!r}")
+        error = json.dumps({"error": str(e)})
+        if self.stream:
+            self.wfile.write(f"data: {error}\n\n".encode())
+            self.wfile.flush()
+        else:
+            self._set_completion_headers(400 if isinstance(e, ValueError) else 500)
+            self.end_headers()
+            self.wfile.write(error.encode())
     finally:
"""


# ResponseGenerator._next_request: the requests taken are kept.
_NEXT_REQUEST = """\
@@ -10,2 +10,5 @@
             pass
-    return self._share_request(request)
+    request = self._share_request(request)
+    if request is not None:
+        self._taken.add(request[0])
+    return request
"""


PATCH = Patch(
    "server_failures",
    "server: a failing request fails alone, with an error to its client; "
    "a non-stream request whose client left is cancelled",
    targets("mlx_lm.server", select, weakref, _failing_alone)
    + targets("mlx_lm.server:ResponseGenerator", ResponseGenerator)
    + edits(
        "mlx_lm.server:ResponseGenerator",
        _next_request=_NEXT_REQUEST,
        _generate=_GENERATE,
    )
    + targets("mlx_lm.server:APIHandler", APIHandler)
    + edits("mlx_lm.server:APIHandler", handle_completion=_HANDLE_COMPLETION),
)
