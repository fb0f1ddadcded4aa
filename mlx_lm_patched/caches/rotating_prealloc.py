"""Preallocated, in-place ``RotatingKVCache`` (its helpers: the new module
``mlx_lm/models/ring_buffer.py``).

Upstream grows the ring in 256-token steps by trim-then-concatenate, so each
growth step briefly holds several copies of every layer's cache, and a
chunked prefill keeps up to ``max_size + S - 1`` tokens per layer. Here the
first update allocates the ``max_size`` ring once; decode and chunks within
the ring write into it in place. A multi-token update that runs past the ring
gives attention a transient of the last ``max_size - 1`` tokens plus the
chunk (the same keys, in the same order, as upstream) and keeps a ring of
the newest tokens, copied from it (writing into the old ring instead would
need a sync inside the model: docs/benchmarks.md). A chunk of 256 tokens or
more is pipelined (``_pipeline``): each layer's update is scheduled and waits
for the previous layer's, so a chunk holds about two layers in flight, not
its whole graph.

Also fixed: ``keep`` tokens stay visible to every query (upstream hides them
from the later queries of a chunk, and rolls the single-token mask as if
``keep=0``), negative trims raise instead of corrupting ``_idx``
(ml-explore/mlx-lm#1776, #1868), updates whose shape does not match the ring
raise before anything changes.

A wrapped ring can step back: ``RotatingKVCache(max_size, keep, slack=n)``
keeps an undo ring of ``2 * n`` slots holding the newest tokens the window
evicted, copied ``n`` at a time just before they are evicted (one gather and
scatter every ``n`` decode steps, which attention depends on, so the ring is
still written in place), and ``trim(k)`` puts back up to ``n`` of them
exactly; ``trimmable_tokens()`` says how many. Beyond that, trims of a
wrapped ring raise and change nothing. With ``slack`` the state carries five
more items (the undo ring, slack and the positions it holds). Upstream cannot
trim a wrapped ring at all, so prefix reuse on sliding-window models and
speculative decoding with a bounded cache fail (ml-explore/mlx-lm#980).

Window checkpoints: a wrapped ring (a sliding layer of gemma3-like models, a
``--max-kv-size`` ring) has forgotten its oldest tokens, so a stored prompt
cache cannot be trimmed back past its slack: a request that shares the first
1,200 tokens of a cached 1,500-token prompt on gemma3_text (window 256)
prefilled all 1,240 of its tokens again (issue #28; llama.cpp keeps
``--ctx-checkpoints`` for the same reason).

A ring made with ``checkpoint_every=n`` (0 takes none) keeps, at each
multiple of ``n`` a multi-token update reaches, a copy of its window in
``checkpoints``, at most ``max_checkpoints`` (8) spread over the whole
history (``_spread``, issue #51): all while they fit, then the newest dense
and older ones thinned geometrically, so a branch ``d`` tokens back has one
within ``d / 2 + 3 * n`` before it (8 cover 24,576 tokens at ``n=512``;
past that the slack grows). An edit far back still reuses most of its
prefix, where the newest 4 reached back 2,048 tokens. A checkpoint is cut
from what attention reads anyway (the sinks, the last window and the
chunk), so nothing is evaluated on its own: the copy is a dependency of the
new ring. It must be a copy: the ring is written in place, and a reference
would make MLX copy the whole ring at the next write. A trim drops the
checkpoints past the new end and ``nbytes`` counts them (a window each, as
many bytes as the ring). Batched rings take them at multiples of ``n``
columns of the batch's timeline, kept where a row's own spread keeps them;
right padding gives a row none past its own tokens; rows keep theirs
through ``merge``, ``extend``, ``filter`` and ``extract``
(``batch_rotating_rows``), spread again over its own positions.
``LRUPromptCache`` restores the nearest one (``prompt_cache_store``).
"""

from typing import TYPE_CHECKING, Optional

import mlx.core as mx

from .._newmods import defined, hooks, new_module
from .._registry import Patch, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    from mlx_lm.models.ring_buffer import (
        _check_update,
        _copy_runs,
        _hold,
        _pipeline,
        _put,
        _ring_checkpoints,
        _ring_slot,
        _sinks_and_newest,
    )

# The state check, a function of the new module that the class binds.
_check_ring_state = defined("mlx_lm.models.ring_buffer", "_check_ring_state")


# The class body is written as it reads in mlx_lm/models/cache.py and runs
# there (``targets`` pastes it).
class RotatingKVCache:
    # Layout of the ``max_size`` ring, ``n = min(offset, max_size)`` tokens live:
    # - ``offset <= max_size``: slot ``s`` holds position ``s``, ``_idx == offset``;
    # - ``offset > max_size``: slots ``[0, keep)`` hold the first ``keep``
    #   positions, slots ``[keep, max_size)`` the last ``max_size - keep`` in
    #   rotated order, the oldest at ``_idx`` (at ``keep`` when ``_idx == max_size``).
    # This is upstream's layout after its trims, so decode sees the same arrays.
    # With ``slack > 0`` an undo ring of ``2 * slack`` slots holds positions
    # ``[_lo, _hi)`` past the first ``keep`` (position ``p`` in slot
    # ``p % (2 * slack)``): the newest evicted tokens and, copied ahead before
    # they are evicted, the oldest in the window, so ``trim`` can put back
    # what it overwrote. Decode copies ``slack`` tokens every ``slack`` steps.

    # Every ``checkpoint_every`` tokens a multi-token update keeps a copy of
    # the window in ``checkpoints``, at most ``max_checkpoints`` spread over
    # the history (``_ring_checkpoints``, ``_spread``); 0: none. ``__init__`` sets these and
    # ``slack``; the class values are those of a ring made from a state
    # (``from_state``).
    slack = 0
    checkpoint_every = 0
    max_checkpoints = 8
    checkpoints = ()

    def __init__(
        self, max_size, keep=0, slack=0, checkpoint_every=0, max_checkpoints=8
    ):
        if max_size < 1:
            raise ValueError(f"RotatingKVCache: max_size must be >= 1, got {max_size}")
        # The newest token needs a slot of its own: a ring no larger than
        # ``keep`` keeps ``max_size - 1`` first tokens.
        self.keep = min(keep, max_size - 1)
        if not 0 <= slack <= max_size - self.keep:
            raise ValueError(
                f"RotatingKVCache: slack must be in [0, {max_size - self.keep}] "
                f"(max_size - keep), got {slack}"
            )
        if checkpoint_every < 0 or max_checkpoints < 1:
            raise ValueError(
                f"RotatingKVCache: need checkpoint_every >= 0 and max_checkpoints "
                f">= 1, got {checkpoint_every} and {max_checkpoints}"
            )
        self.keys = None
        self.values = None
        self.offset = 0
        self.max_size = max_size
        self._idx = 0
        self.slack = slack
        self.checkpoint_every, self.max_checkpoints = checkpoint_every, max_checkpoints
        self._undo_keys = self._undo_values = None
        self._lo = self._hi = 0
        self._step = None  # a decode step's (keys shape, values shape)

    def _allocate(self, keys, values):
        """Allocate the ring, moving in any state saved in another layout."""
        B, H, _, Dk = keys.shape
        k = mx.zeros((B, H, self.max_size, Dk), keys.dtype)
        v = mx.zeros((B, H, self.max_size, values.shape[3]), values.dtype)
        if self.keys is not None:
            n = min(self.offset, self.max_size)
            keep = min(self.keep, n)
            total = self._temporal_order(self.keys).shape[2]
            live = mx.array(
                list(range(keep)) + list(range(total - n + keep, total)), mx.int32
            )
            k = _put(k, self._temporal_order(self.keys)[..., live, :], [0])
            v = _put(v, self._temporal_order(self.values)[..., live, :], [0])
            self._idx = n
        self.keys, self.values = k, v

    def _update_past_ring(self, keys, values):
        """A multi-token update past the ring: attention sees the last
        ``max_size - 1`` tokens and the new ones; the ring keeps the newest."""
        n = min(self.offset, self.max_size)
        m = min(n, self.max_size - 1)
        keep = min(self.keep, n)
        # Slots in temporal order: the ``keep`` first tokens, then the ring
        # from its oldest slot ``_idx``; a full ring's oldest drops out.
        runs = [[0, keep], [self._idx, n], [keep, self._idx]]
        if m < n:
            runs[1 if self._idx < n else 2][0] += 1
        if n == 0:  # a first chunk past the ring: the update as it is, no copy
            seen = [keys, values]
        else:
            seen = [
                mx.concatenate([c[..., a:b, :] for a, b in runs if a < b] + [x], 2)
                for c, x in ((self.keys, keys), (self.values, values))
            ]
        # The ring becomes a copy of the newest tokens: writing into the old
        # one in place would wait for its readers (a sync inside the model).
        self.keys, self.values = (
            _sinks_and_newest(c[..., : self.keep, :], c, self.max_size) for c in seen
        )
        if self.checkpoint_every:
            _ring_checkpoints(self, seen, self.offset - m + self.keep)
        _pipeline((*seen, self.keys, self.values), keys.shape[2])
        self.offset += keys.shape[2]
        self._idx = self.max_size
        first = self.offset - keys.shape[2] - m + keep
        source = (*seen, first, lambda p: p - first + keep)
        return _hold(self, tuple(seen), self.offset, source)

    def update_and_fetch(self, keys, values):
        # A decode step's keys and values are checked against ``_step``, the
        # shapes of a token as the ring holds it, set by a full check, and
        # the ring's dtype: 0.4 us a layer against 1.4 (a GPU's decode step
        # is host bound: on an H100 the host builds and encodes a Llama-8B
        # step in 5-7 ms of its 7).
        if (keys.shape, values.shape) != self._step or not (
            keys.dtype == values.dtype == self.keys.dtype
        ):
            _check_update(self, keys, values)
            if self.keys is None or self.keys.shape[2] != self.max_size:
                self._allocate(keys, values)
            k, v = self.keys, self.values
            self._step = (*k.shape[:2], 1, k.shape[3]), (*v.shape[:2], 1, v.shape[3])
            if keys.shape[2] > 1:
                return self._update_chunk(keys, values)
        # Decode: slot ``_idx``, within the ring or past it.
        if self._idx == self.max_size:
            self._idx = self.keep
        self.keys[:, :, self._idx : self._idx + 1] = keys
        self.values[:, :, self._idx : self._idx + 1] = values
        self.offset += 1
        self._idx += 1
        fetched = self.keys_and_values()
        return _hold(self, fetched, self.offset) if self.slack else fetched

    def _update_chunk(self, keys, values):
        S = keys.shape[2]
        if self.offset + S > self.max_size:
            return self._update_past_ring(keys, values)
        self.keys = _put(self.keys, keys, [self.offset])
        self.values = _put(self.values, values, [self.offset])
        _pipeline((self.keys, self.values), S)
        self.offset += S
        self._idx = self.offset
        return _hold(self, self.keys_and_values(), self.offset)

    def keys_and_values(self):
        # Indexed without an ellipsis: less host time a layer and step.
        if self.offset < self.keys.shape[2]:
            return self.keys[:, :, : self.offset], self.values[:, :, : self.offset]
        return self.keys, self.values

    @property
    def state(self):
        k, v = (None, None) if self.keys is None else self.keys_and_values()
        state = k, v, self.offset, self.keep, self.max_size, self._idx
        if self.slack:
            undo = self._undo_keys, self._undo_values
            state += (*undo, self.slack, self._lo, self._hi)
        return state

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.keep, self.max_size, self._idx = v[:6]
        undo = v[6:] or (None, None, 0, 0, 0)
        self._undo_keys, self._undo_values, self.slack, self._lo, self._hi = undo
        self._step = None

    _check_state = staticmethod(_check_ring_state)

    def trimmable_tokens(self):
        """How many tokens ``trim`` can take off exactly: all of them until
        the ring wraps, then as many as the undo ring holds evicted."""
        oldest = self.offset - self.max_size + self.keep
        if oldest <= self.keep:
            return self.offset
        if not self._lo <= oldest <= self._hi:
            return 0
        return self.offset if self._lo == self.keep else oldest - self._lo

    def trim(self, n):
        name = type(self).__name__
        if not isinstance(n, int):
            raise ValueError(f"{name}.trim: n must be an integer, got {n!r}")
        if n < 0:
            raise ValueError(f"{name}.trim: n must be >= 0, got {n}")
        if self.offset <= self.max_size:
            n = min(self.offset, n)
            self.offset -= n
            self._idx = self.offset
            self._hi = min(self._hi, self.offset)
            self.checkpoints = [c for c in self.checkpoints if c.offset <= self.offset]
            return n
        if n > self.trimmable_tokens():
            raise ValueError(
                f"{name}.trim: the ring has wrapped (offset {self.offset} > "
                f"max_size {self.max_size}) and can put back "
                f"{self.trimmable_tokens()} evicted tokens (slack {self.slack}), "
                f"not {n}; check trimmable_tokens() first"
            )
        # Put the evicted tokens back in the slots of the newest ``n``.
        oldest = self.offset - self.max_size + self.keep
        back = range(max(oldest - n, self.keep), min(oldest, self.offset - n))
        pairs = [(_ring_slot(self, p, self.offset), p % (2 * self.slack)) for p in back]
        _copy_runs(self.keys, self._undo_keys, pairs)
        _copy_runs(self.values, self._undo_values, pairs)
        ring = self.max_size - self.keep
        if self.offset - n <= self.max_size:
            # Unwrapped again: slot ``s`` holds position ``s``.
            order = [
                *range(self.keep),
                *(
                    _ring_slot(self, p, self.offset)
                    for p in range(self.keep, self.max_size)
                ),
            ]
            self.keys = self.keys[..., mx.array(order), :]
            self.values = self.values[..., mx.array(order), :]
            self._idx = self.offset - n
        else:
            self._idx = self.keep + (self._idx - self.keep - n - 1) % ring + 1
        self.offset -= n
        self._hi = min(self._hi, self.offset)
        self.checkpoints = [c for c in self.checkpoints if c.offset <= self.offset]
        return n

    def make_mask(
        self, N: int, window_size: Optional[int] = None, return_array: bool = False
    ):
        # A key is visible if it is one of the ``keep`` first tokens or among
        # the ``window - keep`` newest. ``window`` is the model's
        # ``window_size`` capped at the ring (a sliding layer shrunk by
        # ``max_kv_size``), so chunks and decode agree.
        window = min(window_size or self.max_size, self.max_size)
        if N > 1:
            offset = min(self.max_size - 1, self.offset)
            if offset + N <= window and not return_array:
                return "causal"
            rinds = mx.arange(offset + N)
            linds = mx.arange(offset, offset + N)[:, None]
            recent = linds < rinds + window - self.keep
            return (linds >= rinds) & (recent | (rinds < self.keep))
        if window == self.max_size or self.offset < window:
            return None
        slots = mx.arange(min(self.offset + 1, self.max_size))
        if self.offset < self.max_size:
            distance = self.offset - slots
        else:
            idx = self.keep if self._idx == self.max_size else self._idx
            ring = self.max_size - self.keep
            distance = (idx - slots) % ring
        return (slots < self.keep) | (distance < window - self.keep)

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        held = self.keys, self.values, self._undo_keys, self._undo_values
        return sum(x.nbytes for x in (*held, *self.checkpoints) if x is not None)


PATCH = Patch(
    "rotating_prealloc",
    "RotatingKVCache: allocate the ring once, write in place, keep tokens visible",
    new_module("mlx_lm.models.ring_buffer")
    + hooks(
        "mlx_lm.models.cache",
        "mlx_lm.models.ring_buffer",
        "_check_ring_state",
        "_check_update",
        "_copy_runs",
        "_hold",
        "_pipeline",
        "_put",
        "_ring_checkpoints",
        "_ring_slot",
        "_sinks_and_newest",
        "_spread",
    )
    + targets(
        "mlx_lm.models.cache:RotatingKVCache",
        RotatingKVCache,
        removes=("_trim", "_update_concat", "_update_in_place"),
    ),
)
