"""``PromptTrie.search`` finds the shortest longer entry in time linear in
the trie it walks.

Upstream's search for an entry past the prompt's common prefix walks the
trie depth first, copying each node's token list to its children (``extra
+ [tok]``): a walk down one long entry copies a square of its length. A new
conversation meeting a cached 24k-token one at the chat template's first
tokens waited seconds for its first token (``docs/serving.md``). Here each
node's path is a link to its parent's, unwound once for the entry found:
the same entry, ties broken the same way.
"""

from .._registry import Patch, edits

# search: each node's path a link to its parent's, not a copy per node.
_SEARCH = """\
@@ -31,13 +31,19 @@
     if index > 0:
+        # Each node's path links to its parent's, not a copy per node:
+        # one 24k-token entry made a search copy 288M tokens.
         best = None
-        stack = [(current, [])]
+        stack = [(current, 0, None)]
         while stack:
-            current, extra = stack.pop()
+            current, depth, path = stack.pop()
             if "__value__" in current:
-                if best is None or len(extra) < len(best):
-                    best = extra
-            elif best is None or len(extra) < len(best):
+                if best is None or depth < best[0]:
+                    best = (depth, path)
+            elif best is None or depth < best[0]:
                 for tok in current:
-                    stack.append((current[tok], extra + [tok]))
-        longer = tokens[:index] + best
+                    stack.append((current[tok], depth + 1, (tok, path)))
+        extra, path = [], best[1]
+        while path is not None:
+            tok, path = path
+            extra.append(tok)
+        longer = tokens[:index] + extra[::-1]
     return PromptTrieResult(model, None, shorter, longer, common_prefix)
"""

PATCH = Patch(
    "prompt_trie_search",
    "PromptTrie.search: the shortest longer entry found in linear time, not "
    "by copying each node's path",
    edits("mlx_lm.models.cache:PromptTrie", search=_SEARCH),
)
