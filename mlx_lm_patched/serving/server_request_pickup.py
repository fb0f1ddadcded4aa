"""The server takes a request at the next batch step, not after half a second.

Upstream's generation loop steps its batch for ``TimeBudget``'s 0.5 s
before it looks at the request queue again: a request that comes while
other requests decode waits for the rest of that half second before it is
tokenized, looked up and inserted, 0.25 s on average. Agent and chat loops
that share a server send their next turn while the others decode, so each
turn's time to first token carries it. Here, on a single process, the loop
leaves the budget after the step in which a request was queued. A
distributed server keeps the budget: its ranks must step alike, and only
rank 0 sees the queue.
"""

from .._registry import Patch, edits

# ResponseGenerator._generate: a queued request ends the batch's time budget.
_GENERATE = """\
@@ -313,3 +313,6 @@
 
                 hold_prompt_cache_bytes()
+                if not self._is_distributed and not self.requests.empty():
+                    break  # a request is waiting: taken before the next step
 
             uids_to_remove = self._share_object(uids_to_remove)
"""


PATCH = Patch(
    "server_request_pickup",
    "server: a request queued while the batch decodes is taken at the next "
    "step, not after the batch's 0.5 s time budget",
    edits("mlx_lm.server:ResponseGenerator", _generate=_GENERATE),
)
