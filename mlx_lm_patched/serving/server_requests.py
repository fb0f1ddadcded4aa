"""The server refuses a bad request with a 400 that names what is wrong.

Upstream's ``APIHandler`` checks the types of most parameters but few of
their bounds, and reads any body it is told to (issue 25):

- a ``logit_bias`` token id at or past the vocabulary is scattered into the
  logits unchecked, out of bounds: the process aborts
  (``malloc_consolidate(): invalid chunk size``);
- an empty prompt, ``top_k`` past the vocabulary, ``stop`` words that are
  not strings or ``repetition_context_size`` 10**12 end the generation
  thread: every later request fails and /health is 503 for good;
- a body that is not UTF-8, JSON nested 100,000 deep (``RecursionError``) or
  ``seed: -1`` drop the connection with no status; ``Content-Length: -5``
  reads until the client hangs up, and 10**12 tries to allocate it;
- ``max_tokens`` 2**63, ``true`` for a number and NaN for a float pass.

Here ``do_POST`` refuses a body longer than ``MAX_REQUEST_BYTES`` with a 413
before reading it and one that is not UTF-8 or JSON with a 400;
``validate_model_parameters`` bounds every sampling and generation
parameter (token ids and ``top_k`` by the loaded model's vocabulary, counts
by ``MAX_TOKENS``, floats finite, ``seed`` a uint64) and checks the stop
words and the prompt. A ``logit_bias`` the handler could not check (a
model still loading) fails its request in the generation thread instead of
writing out of bounds (``_make_logits_processors``).
"""

from typing import TYPE_CHECKING

from .._registry import Patch, edits, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    from mlx_lm.server import (
        make_logits_processors,
    )

# A request body larger than this is refused (413) before it is read.
MAX_REQUEST_BYTES = 64 * 2**20
# The most tokens a request may ask for or count back over (int32 positions).
MAX_TOKENS = 2**31 - 1


# Written as it reads in mlx_lm/server.py, and runs there.
def _make_logits_processors(args):
    processors = make_logits_processors(
        args.logits.logit_bias,
        args.logits.repetition_penalty,
        args.logits.repetition_context_size,
        args.logits.presence_penalty,
        args.logits.presence_context_size,
        args.logits.frequency_penalty,
        args.logits.frequency_context_size,
    )
    if args.logits.logit_bias:
        # Scattered unchecked, an id outside the logits writes out of bounds.
        logit_bias_processor = processors[0]
        lowest, highest = min(args.logits.logit_bias), max(args.logits.logit_bias)

        def checked_logit_bias(tokens, logits):
            if lowest < 0 or highest >= logits.shape[-1]:
                raise ValueError(
                    f"logit_bias token ids must be in [0, {logits.shape[-1]})"
                )
            return logit_bias_processor(tokens, logits)

        processors[0] = checked_logit_bias
    return processors


class APIHandler:
    def _vocab_size(self):
        """The number of logits of the loaded model, if it is the one requested."""
        provider = self.response_generator.model_provider
        model, model_key = provider.model, provider.model_key
        requested = self.requested_model
        if requested == "default_model":
            requested = provider.cli_args.model
        if model is None or model_key is None or model_key[0] != requested:
            return None
        return getattr(getattr(model, "args", None), "vocab_size", None)


# APIHandler.do_POST: a body too large, not UTF-8 or not JSON is a 4xx.
_DO_POST = """\
@@ -27,2 +27,4 @@
         content_length = int(content_length)
+        if content_length < 0:
+            raise ValueError
     except ValueError:
@@ -34,2 +36,12 @@
+        return
+    if content_length > MAX_REQUEST_BYTES:
+        self.close_connection = True  # the body is left unread
+        self._set_completion_headers(413)
+        self.end_headers()
+        self.wfile.write(
+            json.dumps(
+                {"error": f"Request body over {MAX_REQUEST_BYTES} bytes"}
+            ).encode()
+        )
         return
     raw_body = self.rfile.read(content_length)
@@ -37,9 +49,11 @@
         self.body = json.loads(raw_body.decode())
-    except json.JSONDecodeError as e:
-        logging.error(f"JSONDecodeError: {e} - Raw body: {raw_body.decode()}")
+    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
+        if isinstance(e, UnicodeDecodeError):
+            error = f"Request body is not UTF-8: {e}"
+        else:
+            error = f"Invalid JSON in request body: {e}"
+        logging.error(f"{error} - Raw body: {raw_body[:1000]!r}")
         self._set_completion_headers(400)
         self.end_headers()
-        self.wfile.write(
-            json.dumps({"error": f"Invalid JSON in request body: {e}"}).encode()
-        )
+        self.wfile.write(json.dumps({"error": error}).encode())
         return
@@ -92,2 +106,3 @@
     self.chat_template_kwargs = self.body.get("chat_template_kwargs")
+    self.stop_words = self.body.get("stop")
     try:
@@ -101,4 +116,3 @@
     # Get stop sequences
-    stop_words = self.body.get("stop")
-    stop_words = stop_words or []
+    stop_words = self.stop_words or []
     stop_words = [stop_words] if isinstance(stop_words, str) else stop_words
"""


# APIHandler._validate: every parameter bounded.
_VALIDATE = """\
@@ -12,3 +12,6 @@
         return
-    if not isinstance(value, expected_type):
+    # JSON's true and false are Python ints
+    if not isinstance(value, expected_type) or (
+        isinstance(value, bool) and expected_type is not bool
+    ):
         try:
@@ -20,2 +23,4 @@
         return
+    if isinstance(value, float) and not abs(value) < float("inf"):
+        raise ValueError(f"{name} must be a finite number")
     if min_val is not None and value < min_val:
"""


# APIHandler.validate_model_parameters: ids and counts bounded.
_VALIDATE_MODEL_PARAMETERS = r'''@@ -2,24 +2,31 @@
     """Validate that the passed model parameters have correct types and values."""
+    number = (float, int)
     self._validate("stream", bool)
-    self._validate("max_tokens", int, min_val=1)
-    self._validate("temperature", (float, int), min_val=0)
-    self._validate("top_p", (float, int), min_val=0, max_val=1)
-    self._validate("top_k", int, min_val=0)
-    self._validate("min_p", (float, int), min_val=0, max_val=1)
-    self._validate("num_draft_tokens", int, min_val=0)
-    self._validate("repetition_penalty", (float, int), min_val=0)
-    self._validate("repetition_context_size", int, min_val=0)
-    self._validate("presence_penalty", (float, int))
-    self._validate("presence_context_size", int, min_val=0)
-    self._validate("frequency_penalty", (float, int))
-    self._validate("frequency_context_size", int, min_val=0)
+    self._validate("stream_options", dict, optional=True)
+    self._validate("max_tokens", int, min_val=1, max_val=MAX_TOKENS)
+    self._validate("temperature", number, min_val=0)
+    self._validate("top_p", number, min_val=0, max_val=1)
+    self._validate("min_p", number, min_val=0, max_val=1)
+    self._validate("num_draft_tokens", int, min_val=0, max_val=MAX_TOKENS)
+    self._validate("repetition_penalty", number, min_val=0)
+    self._validate("repetition_context_size", int, min_val=0, max_val=MAX_TOKENS)
+    self._validate("presence_penalty", number)
+    self._validate("presence_context_size", int, min_val=0, max_val=MAX_TOKENS)
+    self._validate("frequency_penalty", number)
+    self._validate("frequency_context_size", int, min_val=0, max_val=MAX_TOKENS)
     self._validate("logprobs", bool)
     self._validate("top_logprobs", int, min_val=0, max_val=11, whitelist=[-1])
-    self._validate("xtc_probability", float, min_val=0, max_val=1)
-    self._validate("xtc_threshold", float, min_val=0, max_val=1)
+    self._validate("xtc_probability", number, min_val=0, max_val=1)
+    self._validate("xtc_threshold", number, min_val=0, max_val=0.5)
     self._validate("requested_model", str)
     self._validate("adapter", str, optional=True)
-    self._validate("seed", int, optional=True)
+    self._validate("seed", int, optional=True, min_val=0, max_val=2**64 - 1)
+    self._validate("chat_template_kwargs", dict, optional=True)
     self._validate("logit_bias", dict, optional=True)
 
+    # Bounded by the vocabulary where the model is loaded; otherwise
+    # the generation thread checks the logit bias.
+    vocab_size = self._vocab_size()
+    top_k_max = MAX_TOKENS if vocab_size is None else vocab_size - 1
+    self._validate("top_k", int, min_val=0, max_val=top_k_max)
     if self.logit_bias is not None:
@@ -27,3 +34,31 @@
             self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
-        except ValueError as e:
+        except (ValueError, TypeError) as e:
             raise ValueError("logit_bias must be a dict of int to float") from e
+        for k, v in self.logit_bias.items():
+            if k < 0 or (vocab_size is not None and k >= vocab_size):
+                raise ValueError(
+                    f"logit_bias token id {k} is not in [0, {vocab_size})"
+                )
+            if not abs(v) < float("inf"):
+                raise ValueError(f"logit_bias of token {k} must be finite")
+
+    stop = self.stop_words
+    if not (
+        stop is None
+        or isinstance(stop, str)
+        or (isinstance(stop, list) and all(isinstance(s, str) for s in stop))
+    ):
+        raise ValueError("stop must be a string or a list of strings")
+    if isinstance(stop, list) and "" in stop or stop == "":
+        raise ValueError("stop words must not be empty")
+
+    if self.path == "/v1/completions":
+        prompt = self.body.get("prompt")
+        if not isinstance(prompt, str) or not prompt:
+            raise ValueError("prompt must be a non-empty string")
+    else:
+        messages = self.body.get("messages")
+        if not isinstance(messages, list) or not messages:
+            raise ValueError("messages must be a non-empty list")
+        if not all(isinstance(m, dict) for m in messages):
+            raise ValueError("messages must be a list of objects")
'''


PATCH = Patch(
    "server_requests",
    "server: a bad request gets a 400 naming the parameter; a body over "
    "MAX_REQUEST_BYTES a 413",
    targets(
        "mlx_lm.server",
        _make_logits_processors,
        MAX_REQUEST_BYTES=MAX_REQUEST_BYTES,
        MAX_TOKENS=MAX_TOKENS,
    )
    + targets("mlx_lm.server:APIHandler", APIHandler)
    + edits(
        "mlx_lm.server:APIHandler",
        do_POST=_DO_POST,
        _validate=_VALIDATE,
        validate_model_parameters=_VALIDATE_MODEL_PARAMETERS,
    ),
)
