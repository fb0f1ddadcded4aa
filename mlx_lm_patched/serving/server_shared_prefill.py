"""A request sharing a prefix that another request is prefilling waits for it.

Upstream's server looks a request's prefix up in the prompt cache when it
takes the request, and the batch prefills the rest. Requests that come
together behind one system prompt (a fresh server's first clients, agents
started at once) all miss, and the batch prefills that prompt once for each:
8 agent loops behind a 4,096-token system prompt prefill 36,800 tokens where
4,700 are the prompt's and 3,600 their own. Here a request that shares with
a request still prefilling at least ``SHARED_PREFILL_TOKENS`` (512) tokens
that the other stores at a segment's end past what it found cached, and at
least half of what the other prefills, waits in the server until the other's
prefill ends a segment (its system prompt): that segment, which the server
otherwise stores after the first text, is stored at once, the lookup finds
it, and the waiting requests prefill their own tokens beside the rest of the
other's. On an H200 waiting for the first text instead kept the first
request of 8 agent loops half a second ahead of the others for every later
turn: each turn then took more decode steps than the 8 loops in step.
A request waits once; a request that leaves the batch before its first
token (failed, cancelled) lets its waiters go.
"""

from typing import TYPE_CHECKING, Dict, List, Optional

from .._registry import Patch, edits, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    from mlx_lm.server_prompt_cache import common_prefix

# Shared tokens, past what the other request found cached, worth a wait.
SHARED_PREFILL_TOKENS = 512


# Written as it reads in mlx_lm/server.py, and runs there.
def _waits_for(prompt: List[int], prefilling: Dict[int, tuple]) -> Optional[int]:
    """The uid of a request still prefilling whose stored segments will hold
    ``SHARED_PREFILL_TOKENS`` or more of ``prompt`` past what it found
    cached, and at least half of what it prefills; None where none does.
    ``prefilling``: uid -> (prompt, [cached, segment ends...], waiting)."""
    for uid, (other, ends, _) in prefilling.items():
        shared = common_prefix(prompt, other)
        gain = max([e for e in ends if e <= shared], default=ends[0]) - ends[0]
        if gain >= SHARED_PREFILL_TOKENS and 2 * gain >= len(other) - ends[0]:
            return uid
    return None


# ResponseGenerator._generate: requests wait for a shared prefix in flight.
_GENERATE = """\
@@ -18,2 +18,9 @@
     unprocessed_requests = []
+    # uid of a request before its first token -> its prompt, its cached
+    # tokens and segment ends, the requests waiting for them
+    prefilling, waited = {}, set()
+
+    def release(uid):
+        # Its segments stored or gone: the requests waiting for them go on
+        unprocessed_requests.extend(prefilling.pop(uid, (None, None, []))[2])
 
@@ -103,5 +110,12 @@
                 except Exception as e:
                     rqueue.put(e)
                     continue
 
+                shared = None if rqueue in waited else _waits_for(prompt, prefilling)
+                waited.discard(rqueue)  # a request waits once
+                if shared is not None:
+                    waited.add(rqueue)
+                    prefilling[shared][2].append((rqueue, request, args))
+                    continue
+
                 self._log_cache_stats()
@@ -129,2 +143,5 @@
                         break
+                ends = [prompt_cache_count]  # where its segments are stored
+                for s in segments[:-1]:
+                    ends.append(ends[-1] + len(s))
 
@@ -160,2 +177,3 @@
                 timing["insert"] = time.perf_counter()
+                prefilling[uid] = (prompt, ends, [])
                 # just making sure we don't leave a reference around
@@ -263,2 +281,6 @@
                 del caches
+                for uid in eos_ids:  # a prefix requests wait for: stored now
+                    if prefilling.get(uid, (None, None, []))[2]:
+                        store_segments(batch_results[uid])
+                        release(uid)
 
@@ -297,2 +319,3 @@
                         store_segments(result)
+                        release(r.uid)
 
@@ -314,2 +337,4 @@
                 hold_prompt_cache_bytes()
+                if unprocessed_requests:
+                    break  # waiting requests let go: taken before the next step
                 if not self._is_distributed and not self.requests.empty():
@@ -322,2 +346,3 @@
                     store_segments(batch_results.pop(uid, {}))
+                    release(uid)
 
"""


PATCH = Patch(
    "server_shared_prefill",
    "server: a request sharing a long prefix with a request still prefilling "
    "waits for its stored segments instead of prefilling the prefix again",
    targets(
        "mlx_lm.server",
        _waits_for,
        SHARED_PREFILL_TOKENS=SHARED_PREFILL_TOKENS,
    )
    + edits("mlx_lm.server:ResponseGenerator", _generate=_GENERATE),
)
