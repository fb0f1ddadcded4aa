"""``make_prompt_cache(model, max_kv_size)`` bounds every model's cache.

Upstream honours ``max_kv_size`` only for models without ``make_cache``;
llama, gemma3, mistral and most others build their own caches and silently
ignore it, so ``generate --max-kv-size 512`` grows the cache without bound.
Here, when the caller asks for a bound, full-attention ``KVCache`` layers
become ``RotatingKVCache(max_kv_size, keep=4)`` (what upstream gives models
without ``make_cache``), sliding layers keep their window unless it is
larger than ``max_kv_size`` (masks then cap the model's ``window_size`` at
the ring), and every other cache is left as it is. Which layers changed is a
``UserWarning``, once per model type and change, so ``generate`` shows it on
stderr. A ``max_kv_size`` below 1 raises ``ValueError`` before anything is
built; a ring no larger than ``keep`` keeps ``max_kv_size - 1`` first tokens.

``make_prompt_cache(model, max_kv_size, slack=n, checkpoint_every=m)`` makes
every ``RotatingKVCache`` layer with that slack (at most its window) and
checkpoint interval (``rotating_prealloc``): a server
passes them, no class attribute is set for the process.
"""

from typing import TYPE_CHECKING, Any, List

from .._registry import Patch, edits, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    from mlx_lm.models.cache import (
        KVCache,
        RotatingKVCache,
    )

# Written as they would read in mlx_lm/models/cache.py, and run there
# (``KVCache`` and ``RotatingKVCache`` are that module's).

_bounded_logged = set()  # (model type, changes) already reported


def _bound_layers(model, cache: List[Any], max_kv_size: int):
    """Bound ``model``'s ``cache`` in place to ``max_kv_size`` tokens a layer;
    warn which layers changed, once per model type and change."""
    import warnings

    changed = {}  # change -> the layers it applies to
    for i, c in enumerate(cache):
        if type(c) is KVCache:
            cache[i] = RotatingKVCache(max_size=max_kv_size, keep=4)
            change = "KVCache"
        elif type(c) is RotatingKVCache and c.max_size > max_kv_size:
            cache[i] = RotatingKVCache(max_size=max_kv_size, keep=c.keep)
            change = f"RotatingKVCache({c.max_size})"
        else:
            continue
        change += f" -> RotatingKVCache({max_kv_size}, keep={cache[i].keep})"
        changed.setdefault(change, []).append(i)
    name = getattr(model, "model_type", None) or type(model).__qualname__
    key = (name, tuple((c, tuple(v)) for c, v in changed.items()))
    if changed and key not in _bounded_logged:
        _bounded_logged.add(key)
        parts = []
        for c, layers in changed.items():
            runs = []  # consecutive layers as [first, last]
            for i in layers:
                if runs and runs[-1][1] == i - 1:
                    runs[-1][1] = i
                else:
                    runs.append([i, i])
            spans = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
            parts.append(f"layer{'s' * (len(layers) > 1)} {spans}: {c}")
        # A warning, not a log record: CLI users see it on stderr.
        warnings.warn(
            f"mlx_lm_patched: max_kv_size={max_kv_size} bounds "
            f"{sum(map(len, changed.values()))} of {len(cache)} cache layers of "
            f"{name}: " + "; ".join(parts),
            stacklevel=3,
        )


# make_prompt_cache: a model's own cache bounded too; rings with slack and checkpoints.
_MAKE_PROMPT_CACHE = r'''@@ -3,2 +3,4 @@
     max_kv_size: Optional[int] = None,
+    slack: int = 0,
+    checkpoint_every: int = 0,
 ) -> List[Any]:
@@ -12,15 +14,42 @@
         model (nn.Module): The language model.
-        max_kv_size (Optional[int]): If provided and the model does not have a
-            ``make_cache`` method, a ``RotatingKVCache`` is used with a maximum
-            size of ``max_kv_size``
+        max_kv_size (Optional[int]): If provided (at least 1), full-attention
+            layers use a ``RotatingKVCache`` of ``max_kv_size`` tokens (keeping
+            the first 4) and sliding layers a window no larger than
+            ``max_kv_size``.
+        slack (int): Tokens each ``RotatingKVCache`` layer can be trimmed back
+            after it wraps (at most its window). Default: ``0``.
+        checkpoint_every (int): Each ``RotatingKVCache`` layer keeps a copy of
+            its window every this many tokens of a prefill. Default: ``0``,
+            none.
     """
+    if max_kv_size is not None and max_kv_size < 1:
+        raise ValueError(
+            f"max_kv_size must be >= 1 (tokens a layer), got {max_kv_size}"
+        )
     if hasattr(model, "make_cache"):
-        return model.make_cache()
-
-    num_layers = len(model.layers)
-    if max_kv_size is not None:
-        return [
-            RotatingKVCache(max_size=max_kv_size, keep=4) for _ in range(num_layers)
+        cache = model.make_cache()
+        if max_kv_size is not None:
+            _bound_layers(model, cache, max_kv_size)
+    else:
+        num_layers = len(model.layers)
+        if max_kv_size is not None:
+            cache = [
+                RotatingKVCache(max_size=max_kv_size, keep=4) for _ in range(num_layers)
+            ]
+        else:
+            cache = [KVCache() for _ in range(num_layers)]
+    if slack or checkpoint_every:  # the rings made again with them
+        cache = [
+            (
+                RotatingKVCache(
+                    c.max_size,
+                    c.keep,
+                    slack=min(slack, c.max_size - c.keep),
+                    checkpoint_every=checkpoint_every,
+                )
+                if type(c) is RotatingKVCache
+                else c
+            )
+            for c in cache
         ]
-    else:
-        return [KVCache() for _ in range(num_layers)]
+    return cache
'''


PATCH = Patch(
    "max_kv_size",
    "make_prompt_cache: honour max_kv_size for models with make_cache; "
    "rings with slack and checkpoints as asked",
    targets("mlx_lm.models.cache", _bounded_logged=_bounded_logged)
    + targets("mlx_lm.models.cache", _bound_layers)
    + edits("mlx_lm.models.cache", make_prompt_cache=_MAKE_PROMPT_CACHE),
)
