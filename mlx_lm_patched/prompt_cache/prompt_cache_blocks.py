"""Prompt cache entries share fixed-size blocks of their token prefixes (the
new module ``mlx_lm/models/prompt_cache_blocks.py``).

``LRUPromptCache`` stores every entry whole: agents and chat front-ends send
many conversations behind one long system prompt, and each entry holds it
again (8 conversations of a 2,000-token prefix plus 200 tokens of their own
hold 4.67x the bytes of the prefix once plus the 8 tails; upstream 4.89x;
issue #28). vllm-mlx's paged prefix cache and oMLX's blocks share them.

``PromptBlocks`` is the pool an ``LRUPromptCache`` keeps its shared blocks
in (``prompt_cache_store`` calls it when an entry comes to rest, at a fetch
and an eviction).
``share`` cuts each ``KVCache`` or ``QuantizedKVCache`` layer of an entry at
rest (also an entry quantized at rest, ``bits=``) into blocks of
``block_size`` tokens: a block is found by its key, the model key, the
layer, its layout and a SHA-256 chain over the prefix (the block's tokens
and its parent block's digest), so two models, two layouts or two different
prefixes never share one. A block another entry holds is taken as it is,
with one more reference; the tokens after the last whole block stay the
entry's own (``SharedPrefixCache``). ``release`` drops an entry's
references when it leaves (replaced, a prefix popped, evicted): a block
goes with the last entry that holds it, so blocks leave least recently used
with their entries, and ``nbytes`` counts each held block once.
``assemble`` gives the working cache a fetch hands out: its arrays the
blocks and the tail concatenated, its own buffer, so a write never reaches
a block. ``share(..., views=True)`` cuts without copying: what a disk tier
writes of an entry memory keeps whole.

Rotating layers (sliding windows, ``--max-kv-size`` rings), ``CacheList``,
``ArraysCache`` and ``ChunkedKVCache`` layers keep whole entries, as does a
layer holding more tokens than its entry's prompt.
"""

from .._newmods import hooks, new_module
from .._registry import Patch

PATCH = Patch(
    "prompt_cache_blocks",
    "PromptBlocks: prompt cache entries share content-addressed, "
    "reference-counted blocks of their token prefixes, counted once",
    new_module("mlx_lm.models.prompt_cache_blocks")
    + hooks(
        "mlx_lm.models.cache",
        "mlx_lm.models.prompt_cache_blocks",
        "SharedPrefixCache",
        "PromptBlocks",
    ),
)
