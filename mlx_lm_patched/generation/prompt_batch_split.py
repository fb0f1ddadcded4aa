"""``PromptProcessingBatch.split`` moves a batch whose every row goes.

``BatchGenerator`` splits the rows that finished their prompt off the prompt
batch into the generation batch: ``split`` deep-copies the whole batch, then
filters the copy to those rows and the batch to the rest. A server's
requests mostly finish their prompts alone, so every row goes: the deep copy
walks every layer's cache (with window checkpoints, a thousand objects on a
Gemma-3 shape) and each filter gathers every layer again, to end as the
batch it was. On an H200 that was 15-21 ms of an agent turn's host time
before its first token (``docs/serving.md``). Here a split of every row
hands the caches over as they are and leaves the batch empty, as filtering
it to no rows did; a split of some rows copies as before.
"""

from .._registry import Patch, edits

# PromptProcessingBatch.split: every row going, the batch moves.
_SPLIT = """\
@@ -3,2 +3,8 @@
     indices_left = sorted(set(range(len(self.uids))) - set(indices))
+    if not indices_left:  # every row: the caches move, not copied
+        new_batch = copy.copy(self)
+        self.prompt_cache = []  # the new batch's list, which filter clears
+        self.filter([])
+        return new_batch
+
     new_batch = self._copy()
"""


PATCH = Patch(
    "prompt_batch_split",
    "PromptProcessingBatch.split: a split of every row moves the batch, "
    "neither deep-copied nor filtered",
    edits("mlx_lm.generate:PromptProcessingBatch", split=_SPLIT),
)
