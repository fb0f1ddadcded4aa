"""The prompt cache stores live tokens only and holds its byte budget.

Upstream's ``LRUPromptCache`` evicts in four copies of the same five lines
(``insert_cache`` and ``trim_to``, by count and by bytes). Here every
eviction goes through ``_evict``, which pops the least recently used entry,
updates the byte counters and returns ``(model, tokens, entry)``: one place
for a subclass to spill what leaves memory (a disk tier).
"""

from typing import Any, List, Optional

from ._registry import Patch, class_patch


# Written as it reads in mlx_lm/models/cache.py, and runs there.
class LRUPromptCache:
    def insert_cache(
        self,
        model: Any,
        tokens: List[int],
        prompt_cache: List[Any],
        *,
        cache_type: str = "assistant",
    ):
        # Make the cache entry
        entry = LRUPromptCache.CacheEntry(
            prompt_cache, sum(c.nbytes for c in prompt_cache), cache_type
        )

        # Insert into the trie and update the byte counter and lru position
        self._n_bytes += entry.nbytes
        self._n_bytes_by_type[cache_type] += entry.nbytes
        prev = self._trie.add(model, tokens, entry)
        if prev is not None:
            self._n_bytes -= prev.nbytes
            self._n_bytes_by_type[prev.cache_type] -= prev.nbytes
            self._lru.remove(model, tokens)
        self._lru.push(model, tokens, cache_type)

        # If it is a trimmable cache remove all prefixes cause they just take
        # space
        if can_trim_prompt_cache(prompt_cache):
            for prefix_len, entry in self._trie.pop_prefixes(model, tokens):
                self._n_bytes -= entry.nbytes
                self._n_bytes_by_type[entry.cache_type] -= entry.nbytes
                self._lru.remove(model, tokens[:prefix_len])

        # Ensure we match the constraints
        self.trim_to(n_sequences=self.max_size, n_bytes=self.max_bytes)

    def trim_to(
        self, *, n_sequences: Optional[int] = None, n_bytes: Optional[int] = None
    ):
        n_sequences = max(0, n_sequences) if n_sequences is not None else 1 << 63
        n_bytes = max(0, n_bytes) if n_bytes is not None else 1 << 63

        while len(self._lru) > n_sequences:
            self._evict()
        while self._n_bytes > n_bytes:
            self._evict()

    def _evict(self):
        """Drop the least recently used entry; returns ``(model, tokens, entry)``."""
        model, tokens = self._lru.pop()
        entry = self._trie.pop(model, tokens)
        self._n_bytes -= entry.nbytes
        self._n_bytes_by_type[entry.cache_type] -= entry.nbytes
        return model, tokens, entry


PATCH = Patch(
    "prompt_cache_store",
    "LRUPromptCache: one _evict for every eviction",
    class_patch(
        "mlx_lm.models.cache:LRUPromptCache",
        LRUPromptCache,
        {
            "insert_cache": "a7facc577dbf",
            "trim_to": "8e38e6757f09",
            "_evict": None,
        },
    ),
    uses={
        "mlx_lm.models.cache": (
            "Any",
            "List",
            "LRUPromptCache",
            "Optional",
            "can_trim_prompt_cache",
        )
    },
)
