"""A disk tier for prompt caches: entries found again after a restart (the
new module ``mlx_lm/models/prompt_cache_disk.py``).

mlx-lm's prompt cache lives in RAM: what ``LRUPromptCache`` evicts is gone,
and a restarted server starts cold (ml-explore/mlx-lm#1178). Servers built
on mlx-lm keep an SSD tier (vllm-mlx, omlx), and their spills break on the
caches mlx-lm makes: numpy has no bfloat16 ("Item size 2 for PEP 3118 buffer
format string B"), a quantized cache's keys are tuples; their fixes
dequantize and cast to float16 before writing, which changes the tokens.

``DiskPromptCache(directory, max_bytes)`` keeps prompt caches as files
in a ``PromptBlockDir`` (``prompt_cache_dir``: the names, the manifest, the
scan; ``prompt_cache_disk_blocks``: shared prefix blocks as block files
written once, the budget). ``put`` queues the
entry's arrays (``prompt_cache_state``: evaluated on the calling thread,
which another thread cannot do; bfloat16 as its bits, quantized caches as
their packed triples, nothing upcast or copied) and returns (a 524 MB entry
took 1,160 ms when ``put`` copied it itself); a thread copies and writes
them (a locked temporary file renamed into place), reading device copies
packed in a few buffers and brought to host on its own CPU stream, so no
request waits for the GIL while an entry leaves the device
(``_own_copies``, ``_to_host``). Held, they cannot be
donated to an update. The queue holds at most ``queue_bytes`` (past it, an
entry is ``dropped``, warned); ``get`` serves queued entries;
``close(timeout)`` writes the queue in a bounded time. Every entry queued
ends ``written`` or ``dropped``: an error writing one is warned once and
the writer goes on (a ``KeyError`` outside its ``try`` once ended the
thread, and nothing was written after it, #48). ``get`` returns the
longest stored prefix of a prompt (or a longer entry trimmed to it, or back
to its rings' checkpoints, as ``LRUPromptCache.fetch_nearest_cache`` does)
as a working cache, bit for bit, and the tokens left to prefill. It reads
the file in parallel threads, checking each chunk as it lands
(``_read_arrays``), and copies each array into MLX while the next are read:
a 268 MB entry read from the page cache took a median 0.36-0.72 s here,
1.59-1.79 s before (2 loaded CPU cores).

An entry is served only if everything that shapes it is verified: its
manifest digest covers every header field (dtypes, shapes, offsets, tokens,
trim count, cache classes), its CRC-32 its data, its name the hash of its
model and tokens, each layer holds the tokens the header names, and its
layout is the model's own caches' (``prompt_cache_mismatch``). Anything
else is skipped with a warning naming the file, never served and never
raised.

``DiskLRUPromptCache(disk, max_size, max_bytes)`` is an ``LRUPromptCache``
that queues every entry it stores for ``disk`` as it stores it (write-behind:
a server killed a few seconds later keeps it), again when it evicts it
(``_evict``, ``prompt_cache_store``) if it is not on disk by then (a dropped
write), and, where memory holds less of a prompt than the disk tier, serves
it from there, if reading it is expected to be faster than prefilling what it
saves (measured restores against measured prefills): on a GPU, a prefill can
beat the disk (issue #27: 0.96 s of prefill against a 3.31 s restore of a
16k-token Llama-8B-shape prefix). An entry served from disk is kept in
memory too, so a repeat is a memory hit. Each fetch logs which tier served
how many tokens (a disk hit: how many memory had, the bytes read and the
seconds the cost model learns, of the seconds the fetch took).
"""

from .._newmods import new_module
from .._registry import Patch

PATCH = Patch(
    "prompt_cache_disk",
    "DiskPromptCache: prompt caches on disk, written by a background thread, "
    "bit-exact, bounded, found again after a restart; served only if every "
    "header field is verified and the weights are the same, the budget held "
    "for a directory replicas share",
    new_module("mlx_lm.models.prompt_cache_disk"),
    requires=("mlx_lm.models.cache:LRUPromptCache._evict",),
)
