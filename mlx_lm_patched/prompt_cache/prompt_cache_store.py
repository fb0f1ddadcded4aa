"""The prompt cache stores live tokens only, and evicts through one method (its
entries' copies and restore points: the new module
``mlx_lm/models/prompt_cache_entries.py``).

Upstream's ``LRUPromptCache`` stores the caches it is given as they are: with
the preallocated rings of ``rotating_prealloc`` every entry keeps a whole
window per sliding layer (ten 60-token prompts on a tiny gemma3_text with a
1024-token window: 6,553,600 B patched against 1,617,920 B upstream, which
itself keeps 256-token steps of padding); and ``fetch_nearest_cache``
deep-copies the entry on every hit, so a hit briefly holds the entry twice
before the working cache grows (ml-explore/mlx-lm#1395).

Here ``insert_cache`` stores a compact copy (``_copy_cache``): every array
holds exactly the live tokens, copied and evaluated (a wrapped ring in
temporal order; ``KVCache`` and ``ChunkedKVCache`` without their padding;
quantized caches as their packed live tokens; ``CacheList`` and
``ArraysCache`` layer by layer; objects of other classes deep-copied as
upstream fetches them), so an entry's ``nbytes`` is its live tokens'
bytes. ``fetch_nearest_cache`` hands out caches whose arrays share
the entry's buffers: the working cache's first update allocates (a ring its
``max_size`` slots, a ``KVCache`` its next step) and copies the tokens in
once, so a hit peaks at the entry plus one working cache.

``LRUPromptCache(..., bits=8)`` (or 4) keeps entries quantized at rest: each
``KVCache`` layer is stored as a ``QuantizedKVCache`` of ``bits`` and
``group_size``, each ``RotatingKVCache`` (a sliding layer) as a
``QuantizedRotatingKVCache`` of its live tokens, slack and undo ring
included (about 0.53x and 0.28x of bfloat16's bytes with group size 64),
and a fetch gives it back dequantized into a cache of the original class
and dtype, so a batch computes at its own precision while 2-4x more
entries fit (vllm-mlx's ``--kv-cache-quantization`` does the same). It is
for a server whose working caches are not quantized: every quantized entry,
also one read back from a disk tier (``_working``), is dequantized on fetch.

Entries share the blocks of their common prefixes (``prompt_cache_blocks``):
``_settle`` hands the copy to ``self._blocks.share``, a fetch
assembles the entry (``_working_cache``), an entry leaving (replaced, a
prefix popped, evicted) drops its blocks (``_leave``; ``_evict`` returns
its layers holding their blocks, which a disk tier writes as blocks), and
``nbytes`` counts each block once. A conversation's entries share their
rings' window checkpoints too (a fetch hands them on to the next entry):
``nbytes`` counts each once (``_hold``; a Gemma-3 agent loop's store
counted them in every entry, 1.28x its bytes after five entries on the CPU),
and with ``bits`` each is quantized once for all of them (``_rested``).

The entries stored since the last fetch are kept whole, as computed, until
an insert that follows a fetch, or until the byte budget needs room
(``_settle``: cut into blocks, quantized with ``bits``): the next request of
a conversation takes its entry without a join of blocks or a dequantize (an
agent turn on an H200 paid 1.6x for a quantize and a dequantize), and an
entry the next insert extends is dropped without either. The entry that
fetch took stays whole with the next request's (``keep``): a shared system
prompt's entry, which every request behind it takes, was put at rest by the
second request and dequantized by each one after (Gemma-3 on an H200, 8
bits: 1.72x the hit without bits). A server idle for 0.1 s puts them all
at rest (``rest``): 8 concurrent agent loops left three entries whole,
3.54 GB with 4 bits on an H200 where those at rest hold 1.14 GB.

Every eviction goes through ``_evict``, which pops the least recently used
entry, updates the byte counters and returns ``(model, tokens, entry)``: one
place for a subclass to spill what leaves memory (a disk tier). Whether an
entry can be trimmed back to a common prefix is ``_trimmable``.
"""

from typing import TYPE_CHECKING, Any, List, Optional

import mlx.core as mx

from .._newmods import hooks, new_module
from .._registry import Patch, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    import copy

    from mlx_lm.models.cache import (
        KVCache,
        PromptBlocks,
        PromptTrie,
        QuantizedKVCache,
        QuantizedRotatingKVCache,
        RotatingKVCache,
        can_trim_prompt_cache,
        trim_prompt_cache,
    )
    from mlx_lm.models.prompt_cache_entries import (
        _back_to,
        _copy_cache,
        _restore_points,
    )


# Written as it reads in mlx_lm/models/cache.py, and run there.
class LRUPromptCache:
    # Entries kept whole between two fetches at most (a server's request
    # stores up to three: its system prompt's, its prompt's and its end's)
    whole_entries = 3

    def __init__(
        self,
        max_size: int = 10,
        max_bytes: int = 1 << 63,
        *,
        bits: Optional[int] = None,
        group_size: int = 64,
    ):
        # Checked here: a bad size kept nothing, 8.0 bits failed at the first insert.
        if type(max_size) is not int or max_size < 0:
            raise ValueError(
                f"LRUPromptCache: max_size must be an integer >= 0, got {max_size!r}"
            )
        if type(max_bytes) is not int or max_bytes < 0:
            raise ValueError(
                f"LRUPromptCache: max_bytes must be an integer >= 0, got {max_bytes!r}"
            )
        if bits is not None and (type(bits) is not int or bits not in (4, 8)):
            raise ValueError(f"LRUPromptCache: bits must be 4 or 8, got {bits!r}")
        if type(group_size) is not int or group_size not in (32, 64, 128):
            raise ValueError(
                f"LRUPromptCache: group_size must be 32, 64 or 128, got {group_size!r}"
            )
        self.max_size = max_size
        self.max_bytes = max_bytes
        # Entries kept quantized at rest (``KVCache`` layers), dequantized on fetch
        self.bits = bits
        self.group_size = group_size
        self._trie = PromptTrie()
        self._lru = LRUPromptCache.CacheOrder()
        self._n_bytes = 0
        self._n_bytes_by_type = {k: 0 for k in self._lru._ordering}
        self._blocks = PromptBlocks()  # prompt_cache_blocks: shared, counted once
        # id -> [ring checkpoint, entries holding it], and their bytes (_hold);
        # id of one held -> it quantized, once for all entries (_quantized)
        self._checkpoints, self._checkpoint_bytes, self._rested = {}, 0, {}
        # (model, tokens, entry) not at rest yet (_settle); a fetch since,
        # and the entry it took
        self._newest, self._fetched, self._taken = [], False, None

    def _from_checkpoint(self, cache_entry, length, prefix, past=0):
        """A working cache from the newest position at or before ``prefix``
        where every layer of the ``length``-token entry has a checkpoint or
        trims to, and that position; ``(None, 0)`` where there is none past
        ``past`` (an agent loop's turn prefers the previous prompt's entry:
        no working cache is built for nothing)."""
        points = _restore_points(cache_entry.prompt_cache, length)
        at = max((p for p in points if p <= prefix), default=0)
        if at <= past:
            return None, 0
        cache = self._working_cache(cache_entry)
        # A checkpoint quantized at rest is dequantized, as the entry is
        return _back_to(cache, length, at, lambda c: self._working([c])[0]), at

    @property
    def nbytes(self):
        return self._n_bytes + self._blocks.nbytes + self._checkpoint_bytes

    def fetch_nearest_cache(self, model: Any, tokens: List[int]):
        self._fetched, self._taken = True, None
        result = self._trie.search(model, tokens)
        if result.exact is not None:
            cache_entry = self._trie.get(result.model, result.exact)
            return self._working_cache(cache_entry), []

        short_length = len(result.shorter) if result.shorter is not None else 0
        if result.longer is not None and result.common_prefix > short_length:
            cache_entry = self._trie.get(result.model, result.longer)
            prefix = min(len(tokens) - 1, result.common_prefix)
            num_to_trim = len(result.longer) - prefix
            if self._trimmable(cache_entry.prompt_cache, num_to_trim):
                cache = self._working_cache(cache_entry)
                trim_prompt_cache(cache, num_to_trim)
                return cache, tokens[prefix:]
            # A wrapped ring's checkpoint instead (_from_checkpoint)
            if any(getattr(c, "checkpoints", ()) for c in cache_entry.prompt_cache):
                cache, at = self._from_checkpoint(
                    cache_entry, len(result.longer), prefix, short_length
                )
                if cache is not None:
                    return cache, tokens[at:]

        if short_length > 0:
            cache_entry = self._trie.get(result.model, result.shorter)
            return self._working_cache(cache_entry), tokens[short_length:]

        return None, tokens

    def _trimmable(self, prompt_cache: List[Any], n: int) -> bool:
        """Whether ``n`` tokens can be trimmed off a stored entry."""
        return can_trim_prompt_cache(prompt_cache, n)

    def _working_cache(self, cache_entry):
        self._taken = cache_entry  # whole while the next request's are (_settle)
        return self._working(self._blocks.assemble(cache_entry.prompt_cache))

    def _working(self, prompt_cache):
        """A cache to generate with, sharing the stored one's buffers until
        written (quantized at rest: dequantized)."""
        quantized = (QuantizedKVCache, QuantizedRotatingKVCache)
        return [
            (
                c.to_kv_cache()
                if self.bits is not None and isinstance(c, quantized)
                else _copy_cache(c, copy.copy)
            )
            for c in prompt_cache
        ]

    def insert_cache(
        self,
        model: Any,
        tokens: List[int],
        prompt_cache: List[Any],
        *,
        cache_type: str = "assistant",
    ):
        # An entry is found by its tokens: a cache holding more or fewer
        # would be served as a prefix it is not.
        for c in prompt_cache:
            offset = getattr(c, "offset", None)
            if isinstance(offset, int) and offset != len(tokens):
                raise ValueError(
                    f"LRUPromptCache.insert_cache: a {type(c).__name__} holding "
                    f"{offset} tokens given for {len(tokens)} tokens"
                )
        # The same tokens again (a prompt resent, a system prompt shared):
        # the entry held is that cache already, not copied again
        try:
            held = self._trie.get(model, tokens)
        except KeyError:
            held = None
        if held is not None and held.cache_type == cache_type:
            self._lru.remove(model, tokens)
            self._lru.push(model, tokens, cache_type)
            return

        # Store a copy of the live tokens, not the working buffers (whole:
        # cut into blocks by _settle)
        prompt_cache = [self._at_rest(c) for c in prompt_cache]
        # The copies scheduled at once, not a layer at a time
        mx.async_eval([getattr(c, "state", ()) for c in prompt_cache])

        # Make the cache entry
        nbytes = sum(c.nbytes for c in prompt_cache) - self._hold(prompt_cache, 1)
        entry = LRUPromptCache.CacheEntry(prompt_cache, nbytes, cache_type)

        # Insert into the trie and update the byte counter and lru position
        self._n_bytes += entry.nbytes
        self._n_bytes_by_type[cache_type] += entry.nbytes
        prev = self._trie.add(model, tokens, entry)
        if prev is not None:
            self._leave(prev)
            self._n_bytes -= prev.nbytes
            self._n_bytes_by_type[prev.cache_type] -= prev.nbytes
            self._lru.remove(model, tokens)
        self._lru.push(model, tokens, cache_type)

        # If it is a trimmable cache remove all prefixes cause they just take
        # space
        if can_trim_prompt_cache(prompt_cache):
            for prefix_len, entry in self._trie.pop_prefixes(model, tokens):
                self._leave(entry)
                self._n_bytes -= entry.nbytes
                self._n_bytes_by_type[entry.cache_type] -= entry.nbytes
                self._lru.remove(model, tokens[:prefix_len])

        # At rest: the entries stored before the last fetch (those this one
        # did not take the place of); this one after the next fetch
        if self._fetched:
            self._settle(keep=self._taken)
            self._taken = None
        while len(self._newest) >= self.whole_entries:  # the oldest at rest
            self._settle(self._newest[0][2])
        self._newest.append((model, tokens, self._trie.get(model, tokens)))

        # Ensure we match the constraints
        self.trim_to(n_sequences=self.max_size, n_bytes=self.max_bytes)

    def _at_rest(self, cache):
        """A copy of ``cache``'s live tokens as an entry keeps them, lazy
        (``insert_cache`` schedules them). An array of the cache's own that
        holds only live tokens (a row a batch's ``extract`` copied out, as
        the server stores at every request's end) is shared, not copied
        again: a new array object on its buffer, as a fetch hands out (an
        in-place write to the cache's array changes that object only)."""
        own = {id(x) for x in vars(cache).values() if isinstance(x, mx.array)}
        return _copy_cache(
            cache, lambda x: copy.copy(x) if id(x) in own else mx.array(x)
        )

    def _quantized(self, prompt_cache: List[Any]) -> List[Any]:
        """``prompt_cache`` as it rests: with ``bits``, its ``KVCache`` and
        ``RotatingKVCache`` layers quantized (lazy, new objects). A ring's
        checkpoint that entries share is quantized once: each entry's own
        copy held 2.4x the checkpoints' bytes, more than without ``bits``."""
        if self.bits is None:
            return prompt_cache
        layers = []
        for c in prompt_cache:
            if type(c) in (KVCache, RotatingKVCache):
                q = c.to_quantized(group_size=self.group_size, bits=self.bits)
                points = zip(
                    getattr(c, "checkpoints", ()), getattr(q, "checkpoints", ())
                )
                for i, (p, r) in enumerate(points):
                    if r is not p and id(p) in self._checkpoints:
                        q.checkpoints[i] = self._rested.setdefault(id(p), r)
                c = q
            layers.append(c)
        return layers

    def _settle(self, only=None, keep=None):
        """Cut the entries not at rest yet (or ``only`` that one), but
        ``keep``, into shared blocks, quantized with ``bits``."""
        newest, self._newest = self._newest, []
        for model, tokens, entry in newest:
            if (only is not None and entry is not only) or entry is keep:
                self._newest.append((model, tokens, entry))
                continue
            layers = self._quantized(entry.prompt_cache)
            self._hold(entry.prompt_cache, -1)
            mx.async_eval([getattr(c, "state", ()) for c in layers])
            entry.prompt_cache = self._blocks.share(model, tokens, layers)
            nbytes = sum(c.nbytes for c in entry.prompt_cache)
            nbytes -= self._hold(entry.prompt_cache, 1)
            self._n_bytes += nbytes - entry.nbytes
            self._n_bytes_by_type[entry.cache_type] += nbytes - entry.nbytes
            entry.nbytes = nbytes
        if only is None:
            self._fetched = False

    def rest(self) -> bool:
        """Put the entries kept whole at rest, the one a fetch took too: a
        server calls it when idle, when a next request is no longer near
        and the bytes at rest are what it holds. Whether any was whole."""
        if not self._newest:
            return False
        self._settle()
        self._taken = None
        return True

    def _leave(self, entry) -> List[Any]:
        """An entry leaving (replaced, a prefix popped, evicted): its blocks
        dropped and it no longer waits to rest; returns its layers."""
        self._newest = [x for x in self._newest if x[2] is not entry]
        if entry is self._taken:
            self._taken = None
        self._hold(entry.prompt_cache, -1)
        return self._blocks.release(entry.prompt_cache)

    def _hold(self, prompt_cache: List[Any], n: int) -> int:
        """Count the window checkpoints of ``prompt_cache``'s rings held by
        one entry more (``n`` 1) or fewer (-1): a conversation's entries
        share them (a fetch hands them on to the next entry), and ``nbytes``
        counts each once. Returns their bytes, which the entry's own leave
        out."""
        inside = 0
        for c in prompt_cache:
            for point in getattr(c, "checkpoints", ()):
                inside += point.nbytes
                held = self._checkpoints.setdefault(id(point), [point, 0])
                held[1] += n
                if held[1] == 0:
                    del self._checkpoints[id(point)]
                    self._rested.pop(id(point), None)
                    self._checkpoint_bytes -= point.nbytes
                elif held[1] == n == 1:
                    self._checkpoint_bytes += point.nbytes
        return inside

    def trim_to(
        self, *, n_sequences: Optional[int] = None, n_bytes: Optional[int] = None
    ):
        n_sequences = max(0, n_sequences) if n_sequences is not None else 1 << 63
        n_bytes = max(0, n_bytes) if n_bytes is not None else 1 << 63

        while len(self._lru) > n_sequences:
            self._evict()
        if self.nbytes > n_bytes:
            self._settle()
        while self.nbytes > n_bytes:
            self._evict()

    def _evict(self):
        """Drop the least recently used entry; returns ``(model, tokens, entry)``."""
        model, tokens = self._lru.pop()
        entry = self._trie.pop(model, tokens)
        entry.prompt_cache = self._leave(entry)
        self._n_bytes -= entry.nbytes
        self._n_bytes_by_type[entry.cache_type] -= entry.nbytes
        return model, tokens, entry


PATCH = Patch(
    "prompt_cache_store",
    "LRUPromptCache: entries hold live tokens only, fetched without a deep "
    "copy; one _evict for every eviction; a prefix a wrapped ring cannot "
    "trim back to restored from the nearest checkpoint",
    new_module("mlx_lm.models.prompt_cache_entries")
    + hooks(
        "mlx_lm.models.cache",
        "mlx_lm.models.prompt_cache_entries",
        "_back_to",
        "_copy_cache",
        "_restore_points",
    )
    + targets("mlx_lm.models.cache:LRUPromptCache", LRUPromptCache),
    requires=(
        "ring_trim_slack",  # a wrapped ring trims within its slack or raises
        "mlx_lm.models.cache:RotatingKVCache.state",
        "mlx_lm.models.cache:can_trim_prompt_cache",  # (cache, num_tokens)
        "mlx_lm.models.cache:QuantizedRotatingKVCache",  # trims within its slack
    ),
)
