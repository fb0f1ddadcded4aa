"""prompt_cache_disk_blocks: the disk tier writes a prefix entries share as
block files, once per directory (replicas too), reads an entry back from
its blocks and tail bit for bit, removes a block only with the last entry
naming it, and turns every tampered, missing or foreign block into a miss
with a warning."""

import json
import logging
import os
import struct
import threading
import zlib

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, PromptBlocks, QuantizedKVCache
from mlx_lm.models.prompt_cache_disk import DiskLRUPromptCache, DiskPromptCache
from ringref import random_kv, same

pytestmark = pytest.mark.usefixtures("patched")

LAYERS, H, D = 2, 2, 32
PER_TOKEN = LAYERS * 2 * H * D * 4  # float32 keys and values, every layer
SIZE = PromptBlocks().block_size  # memory's blocks, and here block files'


def conversations(n, prefix, tail, first=3):
    """``n`` ``(tokens, cache)`` of ``LAYERS`` ``KVCache`` layers: one
    ``prefix`` (the same tokens from ``first`` on, keys and values in each),
    then ``tail`` tokens of their own."""
    shared = [random_kv(1, H, prefix, D) for _ in range(LAYERS)]
    out = []
    for i in range(n):
        cache = []
        for k0, v0 in shared:
            k, v = random_kv(1, H, tail, D)
            c = KVCache()
            c.update_and_fetch(mx.concatenate([k0, k], 2), mx.concatenate([v0, v], 2))
            cache.append(c)
        mx.eval([c.state for c in cache])
        tokens = [first + j % 500 for j in range(prefix)]
        out.append((tokens + [1000 * (i + 1) + j for j in range(tail)], cache))
    return out


def live(cache):
    return [tuple(x[..., : c.offset, :] for x in c.state[:2]) for c in cache]


def stored(directory, convs, max_bytes=1 << 63, **kwargs):
    """A ``DiskLRUPromptCache`` on ``directory`` that stored ``convs``, its
    writes done."""
    disk = DiskPromptCache(str(directory), max_bytes, block_tokens=SIZE)
    lru = DiskLRUPromptCache(disk, **kwargs)
    for tokens, cache in convs:
        lru.insert_cache("m", tokens, cache)
    lru.disk.flush()
    return lru


def blocks(directory):
    return sorted(f for f in os.listdir(directory) if f.endswith(".block.safetensors"))


def entries(directory):
    return sorted(f for f in os.listdir(directory) if len(f) == 44)


def dir_bytes(directory):
    """The bytes of the entry and block files in ``directory``."""
    return sum(
        os.path.getsize(os.path.join(directory, f))
        for f in os.listdir(directory)
        if f.endswith(".safetensors")
    )


def test_a_shared_prefix_is_on_disk_once(tmp_path):
    """8 conversations of a 2,000-token prefix plus 200 own tokens: the
    directory holds about the prefix once plus the tails (at most 1.3x;
    whole entries hold 8x the prefix), and its budget counts a block once."""
    mx.random.seed(0)
    convs = conversations(8, 2000, 200)
    lru = stored(tmp_path / "blocks", convs, max_size=8)
    once = PER_TOKEN * (2000 + 8 * 200)
    on_disk = dir_bytes(tmp_path / "blocks")
    # The prefix's whole blocks once; each conversation's own blocks.
    assert len(blocks(tmp_path / "blocks")) == 2000 // SIZE + 8 * (
        2200 // SIZE - 2000 // SIZE
    )
    assert on_disk <= 1.3 * once
    assert lru.disk.nbytes == on_disk
    whole = DiskPromptCache(str(tmp_path / "whole"))
    for tokens, cache in convs:  # layers given whole: written whole
        whole.put("m", tokens, cache)
    whole.flush()
    assert dir_bytes(tmp_path / "whole") > 4 * once
    for d in (lru.disk, whole):
        d.close()


def test_a_restart_reads_an_entry_from_its_blocks_bit_for_bit(tmp_path):
    mx.random.seed(1)
    convs = conversations(3, 300, 40)
    stored(tmp_path, convs).disk.close()
    again = DiskPromptCache(str(tmp_path))  # a restart: a new index
    for tokens, cache in convs:
        got, rest = again.get("m", tokens)
        assert rest == [] and same(live(got), live(cache))
        got, rest = again.get("m", tokens[:250] + [7])  # trimmed back
        assert rest == [7] and same(live(got), [
            tuple(x[..., :250, :] for x in kv) for kv in live(cache)
        ])  # fmt: skip
    again.close()


@pytest.mark.parametrize("run_blocks", [None, 2], ids=["whole", "2-block-runs"])
def test_a_restore_joins_each_arrays_blocks_a_run_at_a_time(
    run_blocks, tmp_path, monkeypatch
):
    """The block files of one layout come back as one array per key and
    run, its blocks in order, bit for bit: a few MLX operations a key, not
    a few per block and key (72,000 of a 4-bit 24k-token entry). The first
    run is one block, so reading starts soon; the others are at most
    ``read_threads`` x ``read_chunk`` bytes, so a GPU takes one while the
    next is read."""
    mx.random.seed(2)
    convs = conversations(1, 5 * SIZE, 10)
    stored(tmp_path, convs).disk.close()
    runs = []
    join = DiskPromptCache._join
    monkeypatch.setattr(
        DiskPromptCache,
        "_join",
        lambda self, a, m, found: runs.append(found) or join(self, a, m, found),
    )
    again = DiskPromptCache(str(tmp_path))
    if run_blocks:
        again.read_threads, again.read_chunk = run_blocks, SIZE * PER_TOKEN
    ((tokens, cache),) = convs
    got, _ = again.get("m", tokens)
    again.close()
    (found,) = runs
    want = [SIZE, 4 * SIZE] if run_blocks is None else [SIZE, 2 * SIZE, 2 * SIZE]
    assert len(found) == 2 * LAYERS
    assert all([x.shape[2] for x in v] == want for v in found.values())
    for i, (k, v) in enumerate(live(cache)):
        assert same(mx.concatenate(found[f"{i}.0"], 2), k[..., : 5 * SIZE, :])
        assert same(mx.concatenate(found[f"{i}.1"], 2), v[..., : 5 * SIZE, :])
    assert same(live(got), live(cache))


def test_a_restore_counts_its_block_files_in_the_bytes_it_reads(tmp_path):
    """``read_rate`` and the cost model's bytes are the entry file's and its
    block files' (counting the tail alone made a restore look slow, and a
    server recomputed what it could read)."""
    mx.random.seed(4)
    (tokens, cache), = conversations(1, 300, 10)  # fmt: skip
    stored(tmp_path, [(tokens, cache)]).disk.close()
    again = DiskPromptCache(str(tmp_path))
    again.read_min_bytes = 0  # every restore teaches the rate
    (name,) = entries(tmp_path)
    assert again.get("m", tokens) is not None
    assert again._read[0] == dir_bytes(tmp_path) > 2 * os.path.getsize(tmp_path / name)
    seen = []
    again.get("m", tokens, saves=lambda n, b: seen.append(b) or 1.0)
    assert seen == [dir_bytes(tmp_path)]
    again.close()


def test_block_files_hold_the_disk_tiers_block_tokens_whatever_memorys_blocks(
    tmp_path,
):
    """An entry at rest in memory's blocks of 64 goes to disk in block files
    of ``block_tokens`` (3 x 64 here), read back bit for bit; by default
    (1024 tokens a file: fewer files restore faster) a 1,000-token entry
    is one entry file; a block size under 1 is refused."""
    mx.random.seed(4)
    (tokens, cache), = conversations(1, 990, 10)  # fmt: skip
    disk = DiskPromptCache(str(tmp_path / "three"), block_tokens=3 * SIZE)
    lru = DiskLRUPromptCache(disk)
    lru.spill_at_once = False
    lru.insert_cache("m", tokens, cache)
    lru._settle()  # at rest: memory's blocks of 64
    assert len(lru._blocks) == LAYERS * (1000 // SIZE)
    lru.spill_idle()
    disk.close()
    assert len(blocks(tmp_path / "three")) == 1000 // (3 * SIZE)
    got, rest = DiskPromptCache(str(tmp_path / "three")).get("m", tokens)
    assert rest == [] and same(live(got), live(cache))
    disk = DiskPromptCache(str(tmp_path / "default"))
    assert disk.block_tokens == 1024
    DiskLRUPromptCache(disk).insert_cache("m", tokens, cache)
    disk.close()
    assert (
        blocks(tmp_path / "default") == [] and len(entries(tmp_path / "default")) == 1
    )
    with pytest.raises(ValueError, match="block_tokens must be >= 1"):
        DiskPromptCache(str(tmp_path / "none"), block_tokens=0)


def test_a_queued_entry_is_served_from_its_blocks_before_it_is_written(tmp_path):
    mx.random.seed(2)
    (tokens, cache), = conversations(1, 200, 10)  # fmt: skip
    lru = DiskLRUPromptCache(DiskPromptCache(str(tmp_path), block_tokens=SIZE))
    lru.disk._lock_dir()  # the writer waits: nothing is renamed in
    try:
        lru.insert_cache("m", tokens, cache)
        assert lru.disk.queued == 1 and entries(tmp_path) == []
        got, rest = lru.disk.get("m", tokens)
        assert rest == [] and same(live(got), live(cache))
    finally:
        lru.disk._unlock_dir()
    lru.disk.close()
    assert len(entries(tmp_path)) == 1 and len(blocks(tmp_path)) == 200 // SIZE


def test_a_queued_entry_costs_the_cost_model_the_bytes_its_files_will_hold(
    tmp_path,
):
    """Joining a queued entry copies all of it: counted as free, it was
    restored to save a token (on a GPU, seconds on the serving thread)."""
    mx.random.seed(2)
    (tokens, cache), = conversations(1, 200, 10)  # fmt: skip
    lru = DiskLRUPromptCache(DiskPromptCache(str(tmp_path), block_tokens=SIZE))
    seen = []
    lru.disk._lock_dir()  # the writer waits: nothing is renamed in
    try:
        lru.insert_cache("m", tokens, cache)
        lru.disk.get("m", tokens, saves=lambda n, b: seen.append(b) or 1.0)
    finally:
        lru.disk._unlock_dir()
    lru.disk.close()
    files = dir_bytes(tmp_path)
    assert len(seen) == 1 and 0.95 * files < seen[0] <= files


def test_the_writer_reads_copies_that_share_no_memory_with_the_entry(
    tmp_path, monkeypatch
):
    """On CUDA a host read moves an MLX array's buffer off the device and
    frees it, under the kernels of requests still using it (the server died
    with an illegal memory access): the writer thread reads copies of the
    entry's arrays and its blocks' runs, equal to them, sharing no memory
    (the scalars made for the file, 0 or 1-d, are its own already)."""
    import numpy as np
    from mlx_lm.models import prompt_cache_disk

    mx.random.seed(5)
    (tokens, cache), = conversations(1, 200, 10)  # fmt: skip
    copied, own = [], prompt_cache_disk._own_copies
    monkeypatch.setattr(
        prompt_cache_disk,
        "_own_copies",
        lambda s: copied.append((s, own(s))) or copied[-1][1],
    )
    lru = DiskLRUPromptCache(DiskPromptCache(str(tmp_path), block_tokens=SIZE))
    lru.insert_cache("m", tokens, cache)
    lru.disk.close()
    ((state, theirs),) = copied
    pairs = [(state.arrays[k], theirs.arrays[k]) for k in state.arrays]
    for name, block in state.blocks.items():
        for key, arrays in block.runs.items():
            pairs += [
                (a[-1], b[-1]) for a, b in zip(arrays, theirs.blocks[name].runs[key])
            ]
    assert len(state.blocks) > 1 and len(pairs) > len(state.arrays)
    assert sum(a.ndim > 1 for a, _ in pairs) > len(state.blocks)
    for a, b in pairs:
        a, b = np.asarray(a), np.asarray(b)  # on the CPU: the buffers themselves
        assert np.array_equal(a, b) and (a.ndim < 2 or not np.shares_memory(a, b))
    # Read from one buffer (each host read held the GIL), or from buffers
    # of about blob_bytes, a larger array alone.
    assert len(theirs.blobs) == 1
    big = max(a.nbytes for a, _ in pairs)
    split = own(state, blob_bytes=big)
    assert 1 < len(split.blobs) < len(pairs)
    held = [b for b in split.arrays.values() if hasattr(b, "blobs")]
    for i, blob in enumerate(split.blobs):
        n = sum(b.i == i for b in held)
        assert blob.nbytes <= big or n <= 1
    prompt_cache_disk._to_host(split, mx.new_stream(mx.cpu))
    for k, a in state.arrays.items():
        assert np.array_equal(np.asarray(a), np.asarray(split.arrays[k]))


def test_an_insert_with_the_disk_tier_waits_for_nothing(tmp_path, monkeypatch):
    """Queuing an entry (blocks, state, the writer's copies) schedules its
    arrays and never waits for the device on the serving thread: each wait
    held a request's first token behind every kernel queued; the writer
    thread waits for the copies it reads, and writes what the entry holds."""
    mx.random.seed(6)
    (tokens, cache), = conversations(1, 200, 10)  # fmt: skip
    lru = DiskLRUPromptCache(DiskPromptCache(str(tmp_path), block_tokens=SIZE))
    waits, evaluate = [], mx.eval
    here = threading.current_thread()

    def counted(*a):
        waits.extend([1] if threading.current_thread() is here else [])
        return evaluate(*a)

    monkeypatch.setattr(mx, "eval", counted)
    lru.insert_cache("m", tokens, cache)
    assert lru.disk.queued == 1 and waits == []
    monkeypatch.undo()
    lru.disk.close()
    assert lru.disk.written == 1
    fresh = DiskLRUPromptCache(DiskPromptCache(str(tmp_path), block_tokens=SIZE))
    got, rest = fresh.fetch_nearest_cache("m", tokens)
    assert rest == [] and len(got) == len(cache)
    for a, b in zip(got, cache):
        n = b.offset
        assert same(a.state[:2], (b.keys[..., :n, :], b.values[..., :n, :]))


def test_two_replicas_share_one_set_of_block_files(tmp_path):
    mx.random.seed(3)
    convs = conversations(2, 400, 30)
    a = stored(tmp_path, convs[:1])
    first = {f: os.stat(tmp_path / f).st_ino for f in blocks(tmp_path)}
    b = stored(tmp_path, convs[1:])  # another process's tier, same directory
    assert {f: os.stat(tmp_path / f).st_ino for f in blocks(tmp_path)} == first
    assert len(entries(tmp_path)) == 2
    a.disk._refresh()
    for tier, (tokens, cache) in ((a.disk, convs[1]), (b.disk, convs[0])):
        got, rest = tier.get("m", tokens)  # each the other's entry
        assert rest == [] and same(live(got), live(cache))
    a.disk.close()
    b.disk.close()


def test_eviction_never_removes_a_block_an_entry_names(tmp_path):
    """Under a budget of about three entries, conversations of two prefixes
    come and go: after every write each entry on disk has all its blocks,
    no block is on disk that no entry names, and the files fit the budget."""
    mx.random.seed(4)
    convs = conversations(4, 256, 100) + conversations(4, 192, 100, first=600)
    budget = 3 * PER_TOKEN * 400
    tier = DiskPromptCache(str(tmp_path), budget)
    for tokens, cache in convs:
        tier.put("m", tokens, PromptBlocks().share("m", tokens, cache))
        tier.flush()
        named = set().union(*(tier._refs(e) for e in entries(tmp_path)))
        assert named == set(blocks(tmp_path))
        assert dir_bytes(tmp_path) <= budget and tier.nbytes == dir_bytes(tmp_path)
    assert 1 <= len(entries(tmp_path)) < len(convs)
    for name in entries(tmp_path):
        assert tier._load(name) is not None
    tier.close()


def test_a_block_another_replica_removes_meanwhile_is_written_again(
    tmp_path, monkeypatch
):
    """An entry whose block was on disk when it was queued, removed (the
    last entry naming it evicted by a replica) before the writer takes the
    directory's lock, is written with that block, never without it."""
    mx.random.seed(5)
    convs = conversations(2, 256, 20)
    tier = stored(tmp_path, convs[:1]).disk
    (first,) = entries(tmp_path)
    replica = DiskPromptCache(str(tmp_path))
    seal = DiskPromptCache._seal

    def evicted_meanwhile(self, state):
        if "0.blocks" in state.metadata:  # the entry, sealed before the lock
            os.remove(tmp_path / first)
            replica._lock_dir()
            try:
                replica._shrink()  # its blocks go with it
            finally:
                replica._unlock_dir()
            assert blocks(tmp_path) == []
        return seal(self, state)

    monkeypatch.setattr(DiskPromptCache, "_seal", evicted_meanwhile)
    tokens, cache = convs[1]
    tier.put("m", tokens, PromptBlocks().share("m", tokens, cache))
    tier.flush()
    monkeypatch.undo()
    assert len(blocks(tmp_path)) == 256 // SIZE
    got, rest = DiskPromptCache(str(tmp_path)).get("m", tokens)
    assert rest == [] and same(live(got), live(cache))
    tier.close()
    replica.close()


def reseal(tier, path, edit):
    """Rewrite the header of the file ``path`` with ``edit(header)`` applied
    and its manifest made to match (an attacker can compute it)."""
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    header["__metadata__"]["0.manifest"] = tier._manifest(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little") + text + raw[8 + n :])


def swap_blocks(tier, d):
    a, b = blocks(d)[:2]
    os.replace(d / b, d / a)  # a well-formed block under another's name


def flip_a_bit(tier, d):
    path = d / blocks(d)[0]
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))


def truncate(tier, d):
    path = d / blocks(d)[0]
    os.truncate(path, os.path.getsize(path) - 100)


def other_models_blocks(tier, d):
    """The entry names the blocks another model's entry of the same tokens
    has in the directory (a sound header, resealed)."""
    tokens, cache = CASE
    tier.put("other", tokens, PromptBlocks().share("other", tokens, cache))
    tier.flush()
    other = tier._name(tier._model_key("other"), tokens)
    names = json.loads(tier._read_header(str(d / other), full=True)[1][
        "__metadata__"]["0.blocks"])["files"]  # fmt: skip
    os.remove(d / other)

    def edit(header):
        meta = json.loads(header["__metadata__"]["0.blocks"])
        meta["files"] = names
        header["__metadata__"]["0.blocks"] = json.dumps(meta)

    reseal(tier, d / tier._name(tier._model_key("m"), tokens), edit)


def another_layout(tier, d):
    """A block's header resealed to say it holds float16 keys."""

    def edit(header):
        for k, v in header.items():
            if k != "__metadata__":
                v["dtype"] = "F16"
                v["data_offsets"] = [x // 2 for x in v["data_offsets"]]

    path = d / blocks(d)[0]
    reseal(tier, path, edit)
    n = int.from_bytes(path.read_bytes()[:8], "little")
    os.truncate(path, 8 + n + (os.path.getsize(path) - 8 - n) // 2)


def gapped(tier, d):
    """A block's last array moved 64 bytes on, a gap before it (a sound
    header, resealed): more data than its layout, where its run's buffer
    has room for its layout's bytes only."""
    path = d / blocks(d)[0]
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    last = max(k for k in json.loads(raw[8 : 8 + n]) if k != "__metadata__")

    def edit(header):
        header[last]["data_offsets"] = [x + 64 for x in header[last]["data_offsets"]]

    reseal(tier, path, edit)
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    gap = 8 + n + json.loads(raw[8 : 8 + n])[last]["data_offsets"][0] - 64
    path.write_bytes(raw[:gap] + bytes(64) + raw[gap:])


def nan_resealed(tier, d, pick=lambda keys, header: keys[-1]):
    """A block holding a NaN in its last array (or the one ``pick`` picks),
    its CRC-32 and manifest made to match: the threads check a block file's
    floats as they read them. Returns the array's key."""
    path = d / blocks(d)[0]
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    key = pick(sorted(k for k in header if k != "__metadata__"), header)
    at = 8 + n + header[key]["data_offsets"][0] + 4 * 5
    raw[at : at + 4] = struct.pack("<f", float("nan"))
    path.write_bytes(bytes(raw))

    def edit(header):
        crc = 0
        for k in sorted(k for k in header if k != "__metadata__"):
            a, b = header[k]["data_offsets"]
            crc = zlib.crc32(raw[8 + n + a : 8 + n + b], crc)
        header["__metadata__"]["0.crc32"] = str(crc)

    reseal(tier, path, edit)
    return key


def block_replaced_by(kind):
    """A block file replaced by a link to ``/dev/zero`` (opened, it never
    ends), a directory with a file in it, or a FIFO: kinds that once made
    its prefix a miss for good (#48), or a file it cannot open (EACCES)."""

    def tamper(tier, d):
        path = d / blocks(d)[0]
        if kind == "unreadable":
            if os.geteuid() == 0:
                pytest.skip("root opens a file of mode 000")
            return os.chmod(path, 0)
        os.remove(path)
        if kind == "link":
            os.symlink("/dev/zero", path)
        elif kind == "directory":
            os.mkdir(path)
            (path / "inside").write_bytes(b"x")
        else:
            os.mkfifo(path)

    return tamper


CASE = None


@pytest.mark.parametrize(
    "tamper",
    [
        swap_blocks,
        flip_a_bit,
        truncate,
        lambda tier, d: os.remove(d / blocks(d)[1]),
        other_models_blocks,
        another_layout,
        nan_resealed,
        gapped,
        block_replaced_by("link"),
        block_replaced_by("directory"),
        block_replaced_by("fifo"),
        block_replaced_by("unreadable"),
    ],
    ids=[
        "swapped",
        "flipped",
        "truncated",
        "missing",
        "other_model",
        "other_layout",
        "nan",
        "gapped",
        "link_to_dev_zero",
        "directory",
        "fifo",
        "unreadable",
    ],
)
def test_a_tampered_missing_or_foreign_block_is_a_miss_with_a_warning(
    tamper, tmp_path, caplog
):
    global CASE
    mx.random.seed(6)
    CASE = tokens, cache = conversations(1, 200, 10)[0]
    tier = DiskPromptCache(str(tmp_path))
    tier.put("m", tokens, PromptBlocks().share("m", tokens, cache))
    tier.flush()
    tamper(tier, tmp_path)
    tier.close()
    tier = DiskPromptCache(str(tmp_path))  # a restart, or a replica
    with caplog.at_level(logging.WARNING):
        assert tier.get("m", tokens) is None
    name = tier._name(tier._model_key("m"), tokens)
    assert any(name in r.message and "block" in r.message for r in caplog.records)
    # The tier goes on: the entry written again is served, with its blocks.
    tier.put("m", tokens, PromptBlocks().share("m", tokens, cache))
    tier.flush()
    got, rest = DiskPromptCache(str(tmp_path)).get("m", tokens)
    assert rest == [] and same(live(got), live(cache))
    tier.close()


@pytest.mark.parametrize("bits", [None, 8])
def test_quantized_caches_and_entries_at_rest_are_blocks_too(bits, tmp_path):
    """Working caches quantized (``--kv-bits 4``) or entries quantized at
    rest (``bits=8``, also the entry not quantized yet): their blocks are
    block files, and a restart reads the entry back as memory holds it at
    rest."""
    mx.random.seed(7)
    convs = conversations(2, 200, 30)
    if bits is None:
        convs = [(t, [c.to_quantized(group_size=32, bits=4) for c in cache])
                 for t, cache in convs]  # fmt: skip
    lru = stored(tmp_path, convs, bits=bits, group_size=32)
    assert len(blocks(tmp_path)) == 200 // SIZE and len(entries(tmp_path)) == 2
    lru.disk.close()
    if bits:  # the newest quantized in memory too, as its files hold it
        lru.trim_to(n_bytes=lru.nbytes - 1)
    again = DiskPromptCache(str(tmp_path))
    for tokens, _ in convs:
        got, _ = again.get("m", tokens)
        want = lru._blocks.assemble(lru._trie.get("m", tokens).prompt_cache)
        assert [type(c) for c in got] == [QuantizedKVCache] * LAYERS
        assert same([c.state for c in got], [c.state for c in want])
    again.close()


def test_whole_entry_files_still_load_and_a_newer_format_is_a_miss(tmp_path, caplog):
    """Format 1 (an entry written whole, no ``0.format``) loads as before; a
    format this does not read is a miss with a warning, never a guess."""
    mx.random.seed(8)
    ((tokens, cache),) = conversations(1, 200, 10, first=7)
    ((other, cache2),) = conversations(1, 200, 10, first=700)
    tier = DiskPromptCache(str(tmp_path))
    tier.put("m", tokens, cache)  # whole layers: format 1
    tier.put("m", other, PromptBlocks().share("m", other, cache2))
    tier.flush()
    whole = tmp_path / tier._name(tier._model_key("m"), tokens)
    assert "0.format" not in tier._read_header(str(whole), full=True)[1]["__metadata__"]
    got, _ = DiskPromptCache(str(tmp_path)).get("m", tokens)
    assert same(live(got), live(cache))
    name = tier._name(tier._model_key("m"), other)
    reseal(tier, tmp_path / name, lambda h: h["__metadata__"].update({"0.format": "3"}))
    with caplog.at_level(logging.WARNING):
        assert DiskPromptCache(str(tmp_path)).get("m", other) is None
    assert any(name in r.message and "format '3'" in r.message for r in caplog.records)
    tier.close()


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_directory_never_holds_more_than_its_budget(replicas, tmp_path):
    """Sampled every millisecond without the directory's lock (entries,
    block files and temporary files): never past the budget, with one
    writer or two replicas' writers at once. Before, files were written
    outside the lock and put in place before the eviction pass (#48)."""
    import threading

    mx.random.seed(9)
    convs = conversations(4, 256, 100) + conversations(4, 192, 100, first=600)
    budget = 3 * PER_TOKEN * 400
    tiers = [DiskPromptCache(str(tmp_path), budget) for _ in range(replicas)]
    peak, done = [0], threading.Event()

    def sample():
        while not done.wait(0.001):
            total = 0
            for e in os.scandir(tmp_path):
                try:
                    total += e.stat(follow_symlinks=False).st_size
                except FileNotFoundError:
                    pass
            peak[0] = max(peak[0], total)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        for i, (tokens, cache) in enumerate(convs):
            shared = PromptBlocks().share("m", tokens, cache)
            tiers[i % replicas].put("m", tokens, shared)
        for tier in tiers:
            tier.close()
    finally:
        done.set()
        sampler.join()
    assert 0 < peak[0] <= budget
    assert sum(t.written + t.dropped for t in tiers) == len(convs)


def test_a_nan_among_a_quantized_blocks_packed_arrays_is_found_and_named(
    tmp_path, caplog
):
    """A quantized layer's block file has its float scales and biases between
    its packed uint32 arrays: each is checked as it is read, and the array
    holding a NaN is named."""
    mx.random.seed(8)
    tokens, cache = conversations(1, 200, 10)[0]
    cache = [c.to_quantized(group_size=32, bits=4) for c in cache]
    tier = DiskPromptCache(str(tmp_path))
    tier.put("m", tokens, PromptBlocks().share("m", tokens, cache))
    tier.flush()

    def inner_float(keys, header):
        dtypes = [header[k]["dtype"] for k in keys]
        at = dtypes.index("F32")  # the first float, packed arrays after it
        assert "U32" in dtypes[at:] and dtypes.count("F32") > 1
        return keys[at]

    key = nan_resealed(tier, tmp_path, inner_float)
    tier.close()
    with caplog.at_level(logging.WARNING):
        assert DiskPromptCache(str(tmp_path)).get("m", tokens) is None
    assert any(f"array {key} holds NaN" in r.getMessage() for r in caplog.records)
