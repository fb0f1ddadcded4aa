"""Window checkpoints: a prompt that branches where a ring has wrapped.

A wrapped ring (a sliding layer of gemma3-like models, a ``--max-kv-size``
ring) has forgotten its oldest tokens, so a stored prompt cache cannot be
trimmed back past its slack: a request that shares the first 1,200 tokens of
a cached 1,500-token prompt on gemma3_text (window 256) prefilled all 1,240
of its tokens again, upstream and here (issue #28; llama.cpp keeps
``--ctx-checkpoints`` for the same reason).

With ``RotatingKVCache.checkpoint_every = n`` (and ``BatchRotatingKVCache``'s;
0, the default, takes none; ``mlx_lm_patched.server`` sets 512), a
multi-token update that reaches a multiple of ``n`` keeps a copy of the
window at that position in the ring's ``checkpoints``, at most
``max_checkpoints`` (4), the newest. A checkpoint is cut from what
attention reads anyway (the sinks, the last window and the chunk), so any
prefill chunking works and nothing is evaluated on its own: the copy (one
window a layer, lazily) is a dependency of the new ring, evaluated with it.
It must be a copy: the ring is written in place, and a reference would make
MLX copy the whole ring at the next write instead. A trim drops the
checkpoints past the new end, ``nbytes`` counts them, and entries of
``LRUPromptCache`` keep them (inside ``max_bytes``; each is a window a
rotating layer: a Llama-8B-shaped stack of 4,096-token rings holds 512 MiB
a checkpoint, so up to 2 GiB more a cache): where the longer entry
cannot be trimmed back to a request's common prefix, ``fetch_nearest_cache``
restores the newest position at or before it that every layer can give (a
ring its checkpoint, a ``KVCache`` a trim) and the request prefills from
there.

Batched rings take checkpoints at multiples of ``n`` columns of the batch's
timeline (rows take them at their own positions), and an update with right
padding (prompts of other lengths prefilled together) gives a row none past
its own tokens. Rows keep theirs as they move (``batch_rotating_rows``):
``merge`` (a server batching fetched caches) keeps each row's in
``row_checkpoints``, ``extend`` (a batch joining a running one) cuts the
batch's out per row there, ``filter`` keeps them with their rows, and
``extract`` hands each row its own, the newest ``max_checkpoints``. Quantized
rings, single and batched, keep quantized checkpoints; ``to_quantized``
quantizes a ring's (an entry at rest with ``LRUPromptCache(bits=...)``: 8
bits 0.53x, 4 bits 0.28x of bfloat16's bytes, head dim 128), and a restore
dequantizes the one it takes. The disk tier writes them in the entry's file
(``prompt_cache_state``, ``ring_checkpoints`` in the header), each checked
against its ring when read (``_prompt_cache_from_arrays``; a file that fails
is a miss), and serves a longer entry from them (``_disk_restore_point``,
``_back_to``). An entry counts the checkpoints it shares with another (the
same objects, through a fetch) again in its bytes.
"""

from typing import TYPE_CHECKING

import mlx.core as mx

from .._registry import Patch, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    import copy

    from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache


# Written as they would read in mlx_lm/models/cache.py, and run there.
def _restore_points(cache, length):
    """Positions every layer of ``cache``, a cache of ``length`` tokens, can
    go back to: a ring by a checkpoint, or a trim."""
    found = {c.offset for x in cache for c in getattr(x, "checkpoints", ())}
    return sorted(
        p
        for p in found
        if all(
            any(c.offset == p for c in getattr(layer, "checkpoints", ()))
            or can_trim_prompt_cache([layer], length - p)
            for layer in cache
        )
    )


def _back_to(cache, length, at, working=lambda c: c):
    """``cache``, a cache of ``length`` tokens to change, at ``at`` tokens:
    trimmed, or each ring that cannot be replaced by ``working(its
    checkpoint at at)``, which keeps that checkpoint and the older ones (an
    entry made from it branches back there again); ``None`` where it cannot."""
    if can_trim_prompt_cache(cache, length - at):
        trim_prompt_cache(cache, length - at)
        return cache
    if at not in _restore_points(cache, length):
        return None
    for i, layer in enumerate(cache):
        held = {c.offset: c for c in getattr(layer, "checkpoints", ())}
        if at in held:  # a ring of its own: never in its own checkpoints
            cache[i] = copy.copy(working(held[at]))
            cache[i].checkpoints = [c for p, c in held.items() if p <= at]
        else:
            trim_prompt_cache([layer], length - at)
    return cache


def _disk_restore_point(disk, model, tokens, prefix):
    """How many tokens of ``disk``'s entry of ``tokens`` (a
    ``DiskPromptCache``'s) a prompt sharing ``prefix`` of them can reuse:
    ``prefix`` where it trims back there, else the newest position at or
    before it where each of its rings has a checkpoint, as its header says
    (its other layers are taken to trim; a load checks both), or 0."""
    import json  # local: prompt_cache_dir adds them to the module, later
    import os

    name = disk._name(model, tokens)
    if disk._files[name][2] >= len(tokens) - prefix:
        return prefix
    try:
        state = disk._pending.get(name)
        if state is None:
            path = os.path.join(disk.directory, name)
            meta = disk._read_header(path, full=True)[1]["__metadata__"]
        else:
            meta = state.metadata
        found = {}
        for i, p in json.loads(meta.get("0.ring_checkpoints", "[]")):
            found.setdefault(i, set()).add(p)
    except Exception:  # unreadable: none (a load would say why)
        return 0
    common = set.intersection(*found.values()) if found else set()
    return max((p for p in common if p <= prefix), default=0)


class RotatingKVCache:
    max_checkpoints = 4

    def _checkpoint(self, seen, first):
        """Keep the window at each multiple of ``checkpoint_every`` this
        update reaches; ``seen`` holds the sinks, then positions from ``first``."""
        every, keep = self.checkpoint_every, self.keep
        end = first + seen[0].shape[2] - keep
        taken = [c for c in self.checkpoints if c.offset <= self.offset]
        new = []
        positions = range((max(self.offset, keep) // every + 1) * every, end + 1, every)
        for p in positions[-self.max_checkpoints :]:
            j = p - first + keep
            lo = max(keep, j - self.max_size + keep)
            snap = copy.copy(self)
            snap.keys, snap.values = (
                mx.concatenate([x[..., :keep, :], x[..., lo:j, :]], axis=2)
                for x in seen
            )
            snap.offset, snap._idx, snap.checkpoints = p, min(p, self.max_size), ()
            snap._undo_keys = snap._undo_values = None
            snap._lo = snap._hi = 0
            new += [snap.keys, snap.values]
            taken.append(snap)
        self.checkpoints = taken[-self.max_checkpoints :]
        if new:  # evaluated with the ring
            self.keys, self.values = mx.depends([self.keys, self.values], new)


class QuantizedRotatingKVCache:
    def _join_checkpoints(self, per_part):
        """The checkpoints each quantized part's ring took, joined into ours."""
        taken = list(self.checkpoints)
        for parts in zip(*per_part):
            snap = copy.copy(self)
            snap.keys = tuple(p.keys for p in parts)
            snap.values = tuple(p.values for p in parts)
            snap.offset, snap._idx, snap.checkpoints = (
                parts[0].offset,
                parts[0]._idx,
                (),
            )
            taken.append(snap)
        self.checkpoints = taken[-self.max_checkpoints :]


class BatchRotatingKVCache:
    max_checkpoints = 4

    def _checkpoint(self, sinks, columns, S):
        """Keep the batch at each multiple of ``checkpoint_every`` columns
        this update of ``S`` reached; ``columns`` end at the newest. With
        right padding, a row past its tokens there gets none (offset 0), the
        others theirs before their rolls."""
        every, window = self.checkpoint_every, self.max_size - self.keep
        end, pre, count = self._offset, self._offset - S, columns[0].shape[2]
        start, lengths, roll = end, None, 0
        if self._lengths is not None:  # the rows' tokens this call, given
            lengths, _, given = self._padded
            start, end = end - given, min(end, end - given + max(lengths))
            roll = mx.array([max(0, given - n) for n in lengths])
        taken = [c for c in self.checkpoints if c._offset <= pre]
        new = []
        positions = range((pre // every + 1) * every, end + 1, every)
        for t in positions[-self.max_checkpoints :]:
            live, j = min(t, window), t - self._offset + count
            snap = copy.copy(self)
            snap.keys, snap.values = (
                mx.concatenate([s, x[..., j - live : j, :]], axis=2)
                for s, x in zip(sinks, columns)
            )
            snap._offset, snap._idx, snap.rotated = t, self.keep + live, False
            snap.offset = self.offset + roll - (self._offset - t)
            if lengths is not None:
                real = mx.array([t - start <= n for n in lengths])
                snap.offset = mx.where(real, snap.offset, 0)
            lp = self.left_padding - roll + (self._offset - window)
            snap.left_padding = lp - (t - live)
            snap._undo_keys = snap._undo_values = snap._lengths = None
            snap._lo, snap._hi, snap.checkpoints = 0, 0, ()
            new += [snap.keys, snap.values]
            taken.append(snap)
        self.checkpoints = taken[-self.max_checkpoints :]
        if new:  # evaluated with the ring
            self.keys, self.values = mx.depends([self.keys, self.values], new)


class LRUPromptCache:
    def _from_checkpoint(self, cache_entry, length, prefix):
        """A working cache from the newest position at or before ``prefix``
        where every layer of the ``length``-token entry has a checkpoint or
        trims to, and that position; ``(None, 0)`` where there is none."""
        points = _restore_points(cache_entry.prompt_cache, length)
        at = max((p for p in points if p <= prefix), default=0)
        if at == 0:
            return None, 0
        cache = self._working_cache(cache_entry)
        # A checkpoint quantized at rest is dequantized, as the entry is
        return _back_to(cache, length, at, lambda c: self._working([c])[0]), at


PATCH = Patch(
    "prompt_cache_checkpoints",
    "Rings keep window checkpoints; LRUPromptCache restores the nearest one "
    "before a prefix a wrapped ring cannot trim back to",
    targets("mlx_lm.models.cache", _restore_points, _back_to, _disk_restore_point)
    + targets("mlx_lm.models.cache:RotatingKVCache", RotatingKVCache)
    + targets("mlx_lm.models.cache:QuantizedRotatingKVCache", QuantizedRotatingKVCache)
    + targets("mlx_lm.models.cache:BatchRotatingKVCache", BatchRotatingKVCache)
    + targets("mlx_lm.models.cache:LRUPromptCache", LRUPromptCache),
    requires=(
        "rotating_prealloc",
        "batch_rotating_prealloc",
        "batch_rotating_rows",
        "quantized_ring",
        "ring_trim_slack",
        "prompt_cache_store",
    ),
)
