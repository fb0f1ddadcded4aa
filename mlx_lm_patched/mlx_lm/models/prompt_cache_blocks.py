"""Prompt cache entries share fixed-size blocks of their token prefixes,
content-addressed and reference-counted (``PromptBlocks``)."""

import copy
from typing import Any, List

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map, tree_reduce

from .cache import KVCache, QuantizedKVCache, _BaseCache


class SharedPrefixCache(_BaseCache):
    """An entry's layer at rest: shared ``blocks`` of its prefix, then its
    own ``tail`` (arrays of the tokens after the last whole block)."""

    def __init__(self, template, meta, blocks, tail):
        self.template = template  # the layer at rest, without its arrays
        self.meta = meta  # its state past the arrays (offset, ...)
        self.blocks = blocks  # PromptBlocks' [arrays, references, nbytes, key]
        self.tail = tail
        self.offset = template.offset

    def size(self):
        return self.offset

    def is_trimmable(self):
        return True

    @staticmethod
    def _check_state(v):
        raise ValueError("a SharedPrefixCache lives in a prompt cache, never in a file")

    def whole(self):
        """The layer at rest as ``share`` took it: each run of consecutive
        blocks one slice of its run's arrays, joined to the tail lazily (a
        slice alone where there is nothing to join)."""
        spans = []
        for run, _, _, _, start, stop in self.blocks:
            if spans and spans[-1][0] is run and spans[-1][2] == start:
                spans[-1][2] = stop
            else:
                spans.append([run, start, stop])
        parts = [PromptBlocks.arrays(*span) for span in spans]
        if tree_flatten(self.tail)[0][1].shape[2] or not parts:
            parts.append(self.tail)
        arrays = parts[0]
        if len(parts) > 1:
            arrays = tree_map(lambda *x: mx.concatenate(x, axis=2), *parts)
        cache = copy.copy(self.template)
        cache.state = (*arrays, *self.meta)
        return cache

    @property
    def nbytes(self):
        """The entry's own bytes; its blocks are ``PromptBlocks.nbytes``."""
        return tree_reduce(lambda a, x: a + x.nbytes, self.tail, 0)


class PromptBlocks:
    """The blocks of ``block_size`` tokens entries share, counted once.

    A block is ``[run, references, nbytes, key, start, stop]``: columns
    ``start:stop`` of its run, ``[arrays, live blocks]``, the one copy an
    insert makes of the blocks it adds. A fetch joins a run's consecutive
    blocks as one slice, so an entry costs a few slices, not one per block.
    A block's references never exceed its parent's, so a run's live blocks
    are its first ones: when the last ones leave, the rest are copied to a
    run of their own (``_compact``) and ``nbytes`` is what is held."""

    _chains = {}  # (model, block size) -> (tokens, digests): the last chains

    def __init__(self, block_size: int = 64):
        if block_size < 1:
            raise ValueError(f"PromptBlocks: block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self._blocks = {}  # key -> [run, references, nbytes, key, start, stop]
        self.nbytes = 0

    @staticmethod
    def arrays(run, start: int, stop: int):
        """Columns ``start:stop`` of ``run``'s arrays (a view, no copy)."""
        return tree_map(lambda x: x[..., start:stop, :], run[0])

    def share(
        self, model: Any, tokens: List[int], prompt_cache: List[Any], views=False
    ):
        """``prompt_cache`` (an entry at rest or a working cache, the cache
        of ``tokens``) with the whole blocks of its ``KVCache`` and
        ``QuantizedKVCache`` layers shared, the new blocks (one run) and
        tails copies of their live tokens (with ``views``, views of them:
        what a disk tier writes); other layers as they are."""
        size, digests, new = self.block_size, self.chain(model, tokens), []
        own = (lambda x: x) if views else mx.array
        out = []
        for i, c in enumerate(prompt_cache):
            n = self.count(c, tokens)
            if n == 0:
                out.append(c)
                continue
            state = c.state
            arrays = tree_map(lambda x: x[..., : c.offset, :], state[:2])
            layout = repr(
                (type(c).__name__, state[3:])
                + tuple(
                    (x.dtype, x.shape[:2], x.shape[3:]) for _, x in tree_flatten(arrays)
                )
            )
            keys = [(model, i, layout, digests[j]) for j in range(n)]
            have = 0  # the pool holds a prefix of an entry's blocks
            while have < n and keys[have] in self._blocks:
                have += 1
            if have < n:
                run = [
                    tree_map(lambda x: own(x[..., have * size : n * size, :]), arrays),
                    n - have,
                ]
                new.append(run[0])
                per_block = tree_reduce(lambda a, x: a + x.nbytes, run[0], 0) // (
                    n - have
                )
                for j in range(have, n):
                    at = (j - have) * size
                    self._blocks[keys[j]] = [run, 0, per_block, keys[j], at, at + size]
                self.nbytes += per_block * (n - have)
            blocks = [self._blocks[k] for k in keys]
            for block in blocks:
                block[1] += 1
            tail = tree_map(lambda x: own(x[..., n * size :, :]), arrays)
            new.append(tail)
            template = copy.copy(c)
            template.keys = template.values = None
            out.append(SharedPrefixCache(template, state[2:], blocks, tail))
        if new:  # the new runs' and tails' copies, scheduled at once
            mx.async_eval(new)
        return out

    def chain(self, model: Any, tokens: List[int]) -> List[bytes]:
        """The SHA-256 chain of ``tokens``' whole blocks: each digest covers
        the block's tokens and its parent's digest, the first ``model``. The
        last chains are kept: a conversation's next insert hashes only the
        blocks it adds."""
        import hashlib  # local: prompt_cache_dir adds it to the module, later

        size, n = self.block_size, 0
        was_tokens, was = PromptBlocks._chains.pop((model, size), ([], []))
        end, at = min(len(was), len(tokens) // size), slice(0, size)
        while n < end and list(tokens[at]) == was_tokens[at]:
            n, at = n + 1, slice(at.stop, at.stop + size)
        digests = was[:n]
        seed = digests[-1] if n else hashlib.sha256(repr(model).encode()).digest()
        for start in range(n * size, len(tokens) - size + 1, size):
            block = repr(list(tokens[start : start + size])).encode()
            seed = hashlib.sha256(seed + block).digest()
            digests.append(seed)
        PromptBlocks._chains[model, size] = (
            list(tokens[: len(digests) * size]),
            digests,
        )
        while len(PromptBlocks._chains) > 4:  # the oldest chain goes
            del PromptBlocks._chains[next(iter(PromptBlocks._chains))]
        return list(digests)

    def count(self, cache: Any, tokens: List[int]) -> int:
        """The whole blocks ``share`` cuts ``cache``, the cache of ``tokens``,
        into (0: it keeps the layer whole)."""
        if type(cache) not in (KVCache, QuantizedKVCache) or cache.keys is None:
            return 0
        return 0 if cache.offset > len(tokens) else cache.offset // self.block_size

    def release(self, prompt_cache: List[Any]) -> List[Any]:
        """Drop an entry's references to its blocks (a block no entry holds
        leaves the pool); returns its layers, which still hold their blocks'
        arrays, for a disk tier."""
        runs = {}
        for c in prompt_cache:
            for block in c.blocks if isinstance(c, SharedPrefixCache) else ():
                block[1] -= 1
                if block[1] == 0:
                    del self._blocks[block[3]]
                    self.nbytes -= block[2]
                    block[0][1] -= 1
                    runs[id(block[0])] = block[0]
        self._compact([run for run in runs.values() if run[1]])
        return prompt_cache

    def _compact(self, runs: List[Any]):
        """Copy the live blocks of ``runs`` (their first ones) to arrays of
        their own, so the arrays of the blocks that left are freed."""
        for run in runs:
            run[0] = tree_map(
                lambda x: mx.array(x[..., : run[1] * self.block_size, :]), run[0]
            )
        if runs:
            mx.async_eval([run[0] for run in runs])

    def assemble(self, prompt_cache: List[Any]) -> List[Any]:
        """The entry's layers as the caches ``share`` was given, each shared
        layer's blocks and tail joined (a slice of one run where it can)."""
        return [
            c.whole() if isinstance(c, SharedPrefixCache) else c for c in prompt_cache
        ]

    def __len__(self):
        return len(self._blocks)
