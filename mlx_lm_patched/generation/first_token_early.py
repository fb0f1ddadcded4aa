"""``GenerationBatch.next`` returns a row's first token before it encodes
the next step.

Each ``next`` encodes the next decode step (``mx.async_eval``), then waits
for the tokens of the one before and returns them: the GPU computes a step
while the host encodes the following one. For a row's first token that
order costs time to first token: its step was encoded when the batch was
made, so the token is ready, but it goes out only after a whole step more
is encoded. A decode step of an 8B model on an H200 is host-bound there,
12-15 ms of ``async_eval`` per step (``docs/serving.md``), which every
request of a server waited for before its first token. Here a call that
returns a row's first token (``_take``) encodes nothing; the step of the
tokens it returned is encoded at the batch's next call, or before the
batch changes (``extend``, ``filter``, ``extract_cache``: ``_resume``). The
tokens are the same; the encodes are as many.
"""

from typing import TYPE_CHECKING

from .._registry import Patch, edits, targets

if TYPE_CHECKING:  # names the code below finds in mlx_lm/generate.py
    import mlx.core as mx


class GenerationBatch:
    # True while the tokens the last call returned have no step encoded
    _held = False

    def _take(self):
        """The tokens scheduled, as ``_step`` returns them, without encoding
        their step (``_resume`` does)."""
        self._current_tokens = self._next_tokens
        self._current_logprobs = self._next_logprobs
        self._held = True
        mx.eval(self._current_tokens, self._current_logprobs)
        tokens = self._current_tokens.tolist()
        for sti, ti in zip(self.tokens, tokens):
            sti.append(ti)
        return tokens, self._current_logprobs

    def _resume(self):
        """Encode the step of the tokens ``_take`` returned: ``_step`` again
        on them (its tokens back off ``self.tokens``, which it appends)."""
        if not self._held:
            return
        self._held = False
        self._next_tokens = self._current_tokens
        self._next_logprobs = self._current_logprobs
        for sti in self.tokens:
            sti.pop()
        self._step()


# GenerationBatch.next: a row's first token goes out before the next step.
_NEXT = """\
@@ -10,3 +10,5 @@
 
-    tokens, logprobs = self._step()
+    self._resume()
+    first = 0 in self._num_tokens  # a row's first token: out before a step
+    tokens, logprobs = self._take() if first else self._step()
 
"""
# GenerationBatch.extend, filter, extract_cache: the held tokens' step first.
_EXTEND = """\
@@ -2,2 +2,4 @@
     \"\"\"Extend this batch with another generation batch.\"\"\"
+    self._resume()
+    batch._resume()
     self.uids.extend(batch.uids)
"""
_FILTER = """\
@@ -2,2 +2,3 @@
     \"\"\"Filter the batch to keep only the specified indices.\"\"\"
+    self._resume()
     self.uids = [self.uids[idx] for idx in keep]
"""
_EXTRACT_CACHE = """\
@@ -1,2 +1,3 @@
 def extract_cache(self, idx: int) -> List[Any]:
+    self._resume()
     return [c.extract(idx) for c in self.prompt_cache]
"""


PATCH = Patch(
    "first_token_early",
    "GenerationBatch.next: a row's first token is returned before the next "
    "decode step is encoded",
    targets("mlx_lm.generate:GenerationBatch", GenerationBatch)
    + edits(
        "mlx_lm.generate:GenerationBatch",
        next=_NEXT,
        extend=_EXTEND,
        filter=_FILTER,
        extract_cache=_EXTRACT_CACHE,
    ),
)
