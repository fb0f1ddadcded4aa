"""Block files: a prefix that entries share is on disk once (the new module
``mlx_lm/models/prompt_cache_disk_blocks.py``).

The disk tier (``prompt_cache_disk``) wrote every entry whole: an entry
whose layers share blocks in memory (``prompt_cache_blocks``) was joined
on the serving thread (a copy of the entry) and its prefix written again
with every conversation behind it (issue #28).

``PromptBlockDir`` is the ``PromptCacheDir`` the disk tier stands on, with
block files. An entry's shared layers (``SharedPrefixCache``) are written
as their tails: each such layer's arrays hold the tokens after its last
whole block, its scalars the whole layer's, and the metadata ``0.blocks``
(JSON: ``size``, the block size; ``layers``, each shared layer's block
count; ``files``, the block files in order) names the rest. Block file
``j``, ``<32 hex>.block.safetensors``, holds block ``j`` of each shared
layer that has one, under the entry's own array keys; it is named by a
digest of the model key, those layers and their layouts (class, dtypes,
shapes past the token axis), and the SHA-256 chain of the tokens up to its
end (``PromptBlocks.chain``), and its header says each of these, sealed
by a manifest and a CRC-32 of its data as entries are. Every entry and
every replica on the directory that holds the same prefix names the same
files; entries without ``0.blocks`` are whole (the first format) and
load as before.

Writing: under the directory's ``flock`` the writer thread first makes
room for the entry's file and the block files not yet on disk (``_shrink``
with ``room``: every entry, block and temporary file counted, a block
once; the least recently used entries go, and a block goes when no
remaining entry, nor the entry being written, names it), then writes them
to locked temporary files and renames the blocks, then the entry, into
place: no entry on disk ever names a block that is not, and the directory
never holds more than its budget, replicas' writes included (one replica
at 300 KB peaked at 2.03x its budget when files were put in place before
the eviction pass, #48). Reading: the block files an entry names are
checked against what its own model, tokens and layers make them (another
model's or layout's block is refused), then read in parallel, each
checked as an entry is (header, manifest, CRC-32, finite floats) and for
the dtypes and shapes its entry needs; anything else is a miss with a
warning, and a block that is unsound or cannot be read (a link, a
directory, a FIFO, ``EACCES``) is set aside so the next write replaces it.
"""

from .._newmods import new_module
from .._registry import Patch

PATCH = Patch(
    "prompt_cache_disk_blocks",
    "PromptBlockDir: the disk tier writes shared prefix blocks as block files, "
    "once per directory, named by content, removed with the last entry naming them",
    new_module("mlx_lm.models.prompt_cache_disk_blocks"),
)
