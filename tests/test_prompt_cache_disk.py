"""Disk tier: ``DiskPromptCache`` writes prompt caches on a background
thread and finds them again after a restart, bit for bit (bfloat16,
quantized, rings), bounded by its byte budget; corrupt, truncated and
foreign files are skipped with a warning naming them. ``DiskLRUPromptCache``
queues what memory stores (write-behind) and reads it back where upstream's
``LRUPromptCache`` has nothing."""

import copy
import json
import logging
import os
import sys
import threading
import time

import mlx.core as mx
import pytest
from ringref import random_kv, same, single_stream

pytestmark = pytest.mark.usefixtures("patched")

PROMPT = [(i * 37) % 500 + 3 for i in range(500)]
EXTRA = [7, 11, 13, 17, 19]
MODEL = ("tiny", None, None)  # a server's model key: (model, adapter, draft)
STEPS = 12

# name: (family, dtype, kv_bits): the caches a server holds.
KINDS = {
    "bfloat16": ("llama", "bfloat16", None),
    "quantized": ("llama", "bfloat16", 4),
    "ring": ("llama_sliding", "bfloat16", None),
}


def prefilled(model, tokens, kv_bits=None, slack=0):
    """``model``'s cache (rings with ``slack``: patched) after ``tokens``."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model, slack=slack) if slack else make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    if kv_bits:
        cache = [c.to_quantized(group_size=64, bits=kv_bits) for c in cache]
    mx.eval([c.state for c in cache])
    return cache


def states(cache):
    return [c.state for c in cache]


def live(cache):
    """The tokens ``KVCache`` layers hold, without their padding."""
    return [(c.keys[..., : c.offset, :], c.values[..., : c.offset, :]) for c in cache]


def held(cache):
    """Per layer: offset, ring slot, and the tokens its slots hold."""
    return [
        (c.offset, getattr(c, "_idx", 0))
        + tuple(x[..., : min(c.offset, x.shape[2]), :] for x in (c.keys, c.values))
        for c in cache
    ]


def disk(directory, max_bytes=1 << 63, **kwargs):
    from mlx_lm.models.prompt_cache_disk import DiskPromptCache

    return DiskPromptCache(str(directory), max_bytes, **kwargs)


def written(directory, *entries, max_bytes=1 << 63):
    """A closed tier in ``directory`` holding ``entries`` of (tokens, cache)."""
    tier = disk(directory, max_bytes)
    for tokens, cache in entries:
        tier.put(MODEL, tokens, cache)
        tier.flush()
    tier.close()
    return tier


def files(directory):
    """The files in ``directory`` but block files (prompt_cache_disk_blocks)
    and the rates measured (``rates_file``)."""
    return sorted(
        f for f in os.listdir(directory) if ".block." not in f and f != ".rates.json"
    )


@pytest.mark.parametrize("kind", list(KINDS))
def test_restored_cache_is_bit_exact_after_restart_and_continues_alike(
    kind, load_tiny, tmp_path
):
    family, dtype, kv_bits = KINDS[kind]
    model, _ = load_tiny(family, dtype=dtype)
    cache = prefilled(model, PROMPT, kv_bits)
    kept = copy.deepcopy(cache)
    written(tmp_path, (PROMPT, cache))

    restored, rest = disk(tmp_path).get(MODEL, PROMPT + EXTRA)

    assert rest == EXTRA
    assert [type(c) for c in restored] == [type(c) for c in kept]
    assert same(states(restored), states(kept))
    dtypes = {a.dtype for s in states(restored) for a in s if isinstance(a, mx.array)}
    assert mx.float32 not in dtypes  # nothing upcast
    expected, _ = single_stream(model, EXTRA, STEPS, cache=kept)
    assert single_stream(model, rest, STEPS, cache=restored)[0] == expected


def test_longest_stored_prefix_is_served_and_models_do_not_mix(load_tiny, tmp_path):
    model, _ = load_tiny("llama")
    short, long = PROMPT[:100], PROMPT[:300]
    written(tmp_path, (short, prefilled(model, short)), (long, prefilled(model, long)))
    tier = disk(tmp_path)

    cache, rest = tier.get(MODEL, PROMPT[:400])
    assert rest == PROMPT[300:400] and cache[0].offset == 300
    cache, rest = tier.get(MODEL, PROMPT[:200])
    assert rest == PROMPT[199:200] and cache[0].offset == 199  # 300 trimmed back
    assert tier.get(MODEL, PROMPT[:400], cached=300) is None
    assert tier.get(("other", None, None), PROMPT[:400]) is None
    assert tier.get(MODEL, EXTRA) is None


def test_longer_entry_is_trimmed_to_the_common_prefix_only_when_it_can_be(
    load_tiny, tmp_path
):
    model, _ = load_tiny("llama")
    cache = prefilled(model, PROMPT)
    written(tmp_path, (PROMPT, cache))

    restored, rest = disk(tmp_path).get(MODEL, PROMPT[:250] + EXTRA)

    assert rest == EXTRA and restored[0].offset == 250
    assert same(
        live(restored), [(k[..., :250, :], v[..., :250, :]) for k, v in live(cache)]
    )

    ring_model, _ = load_tiny("llama_sliding", dtype="bfloat16")
    written(tmp_path / "ring", (PROMPT, prefilled(ring_model, PROMPT)))
    # The wrapped window cannot step back: nothing is served.
    assert disk(tmp_path / "ring").get(MODEL, PROMPT[:250] + EXTRA) is None


def test_a_wrapped_ring_steps_back_from_disk_within_its_slack(tmp_path):
    from mlx_lm.models.cache import KVCache, RotatingKVCache, trim_prompt_cache

    tokens = PROMPT[:20]
    cache = [KVCache(), RotatingKVCache(8, keep=2, slack=3)]
    for c in cache:
        c.update_and_fetch(*random_kv(1, 1, 20, 4))
    expected = copy.deepcopy(cache)
    trim_prompt_cache(expected, 3)
    written(tmp_path, (tokens, cache))
    tier = disk(tmp_path)

    restored, rest = tier.get(MODEL, tokens[:17] + EXTRA)

    assert rest == EXTRA and same(states(restored), states(expected))
    assert tier.get(MODEL, tokens[:16] + EXTRA) is None  # 4 tokens: past the slack


def test_what_is_written_is_the_cache_as_put_while_the_caller_goes_on(
    load_tiny, tmp_path
):
    model, _ = load_tiny("llama")
    cache = prefilled(model, PROMPT)
    kept = copy.deepcopy(cache)
    tier = disk(tmp_path)
    tier.put(MODEL, PROMPT, cache)
    model(mx.array(EXTRA)[None], cache=cache)  # the caller goes on using it
    tier.close()

    restored, rest = disk(tmp_path).get(MODEL, PROMPT + EXTRA)

    assert rest == EXTRA and same(states(restored), states(kept))
    assert [f for f in files(tmp_path) if not f.endswith(".safetensors")] == []


def test_budget_drops_the_least_recently_used_files(load_tiny, tmp_path, monkeypatch):
    from mlx_lm.models.prompt_cache_disk import DiskPromptCache

    model, _ = load_tiny("llama")
    monkeypatch.setattr(DiskPromptCache, "read_min_bytes", 0)  # rates written
    a, b, c = ([t] + PROMPT[:200] for t in (1, 2, 4))
    one = written(tmp_path / "one", (a, prefilled(model, a))).nbytes
    tmp_path = tmp_path / "tier"
    tier = disk(tmp_path, max_bytes=2 * one + one // 2)
    for tokens in (a, b):
        tier.put(MODEL, tokens, prefilled(model, tokens))
        tier.flush()
    assert tier.get(MODEL, a + EXTRA) is not None  # a is now the most recent
    tier.put(MODEL, c, prefilled(model, c))
    tier.close()

    rates = tmp_path / ".rates.json"  # the restore's rate, counted too
    assert len(files(tmp_path)) == 2 and tier.nbytes == 2 * one + rates.stat().st_size
    restarted = disk(tmp_path)
    assert restarted.get(MODEL, b + EXTRA) is None
    assert restarted.get(MODEL, a + EXTRA)[1] == EXTRA
    assert restarted.get(MODEL, c + EXTRA)[1] == EXTRA
    # A smaller budget after a restart drops files at once, oldest first.
    smaller = disk(tmp_path, max_bytes=one + rates.stat().st_size)
    assert len(smaller) == 1 and len(files(tmp_path)) == 1


def test_corrupt_truncated_and_foreign_files_are_skipped_with_a_warning(
    load_tiny, tmp_path, caplog
):
    model, _ = load_tiny("llama")
    prompts = {name: [t] + PROMPT[:200] for t, name in enumerate("abcd", 1)}
    for name, tokens in prompts.items():
        written(tmp_path / name, (tokens, prefilled(model, tokens)))
        (entry,) = os.listdir(tmp_path / name)
        os.replace(tmp_path / name / entry, tmp_path / entry)
        prompts[name] = (tokens, tmp_path / entry)
    with open(prompts["b"][1], "r+b") as f:  # truncated
        f.truncate(os.path.getsize(prompts["b"][1]) - 100)
    with open(prompts["c"][1], "r+b") as f:  # a flipped bit in its data
        f.seek(-10, os.SEEK_END)
        byte = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([byte[0] ^ 1]))
    renamed = tmp_path / ("0" * 32 + ".safetensors")
    os.replace(prompts["d"][1], renamed)
    foreign = tmp_path / "foreign.safetensors"
    foreign.write_bytes(os.urandom(3000))
    weights = tmp_path / "weights.safetensors"
    mx.save_safetensors(str(weights), {"w": mx.zeros((4, 4))})
    (tmp_path / "subdir").mkdir()
    caplog.set_level(logging.WARNING)

    tier = disk(tmp_path)

    warned = caplog.text
    for path in (prompts["b"][1], renamed, foreign, weights, tmp_path / "subdir"):
        assert str(path) in warned
    assert str(prompts["a"][1]) not in warned
    assert str(prompts["c"][1]) not in warned  # its header is sound
    assert len(tier) == 2
    assert tier.get(MODEL, prompts["c"][0] + EXTRA) is None
    assert f"{prompts['c'][1]}: ValueError('its data does not match" in caplog.text
    assert len(tier) == 1
    assert tier.get(MODEL, prompts["a"][0] + EXTRA)[1] == EXTRA
    assert tier.get(MODEL, prompts["b"][0] + EXTRA) is None


def test_bad_input_raises_value_error(tmp_path, load_tiny):
    from mlx_lm.models.prompt_cache_disk import DiskPromptCache

    with pytest.raises(ValueError, match="max_bytes must be >= 0, got -1"):
        DiskPromptCache(str(tmp_path), -1)
    tier = disk(tmp_path)
    tier.close()
    model, _ = load_tiny("llama")
    with pytest.raises(ValueError, match="after close"):
        tier.put(MODEL, PROMPT[:10], prefilled(model, PROMPT[:10]))
    assert files(tmp_path) == []


def test_evicted_entries_are_read_back_where_upstream_has_none(load_tiny, tmp_path):
    from mlx_lm.models.cache import LRUPromptCache
    from mlx_lm.models.prompt_cache_disk import DiskLRUPromptCache

    import mlx_lm_patched

    model, _ = load_tiny("llama")
    first, second = PROMPT[:300], PROMPT[300:]

    def fetch_after_eviction(prompt_cache):
        prompt_cache.insert_cache(MODEL, first, prefilled(model, first))
        prompt_cache.insert_cache(MODEL, second, prefilled(model, second))
        return prompt_cache

    tier = disk(tmp_path)
    lru = fetch_after_eviction(DiskLRUPromptCache(tier, max_size=1))
    tier.flush()
    cache, rest = lru.fetch_nearest_cache(MODEL, first + EXTRA)
    assert rest == EXTRA and same(live(cache), live(prefilled(model, first)))
    # What memory still holds comes from memory.
    assert lru.fetch_nearest_cache(MODEL, second + EXTRA)[1] == EXTRA
    assert lru.fetch_nearest_cache(MODEL, EXTRA) == (None, EXTRA)
    tier.close()

    mlx_lm_patched.revert()
    upstream = fetch_after_eviction(LRUPromptCache(max_size=1))
    assert upstream.fetch_nearest_cache(MODEL, first + EXTRA) == (None, first + EXTRA)


@pytest.mark.parametrize("bits, most", [(8, 0.55), (4, 0.30)])
def test_the_disk_tier_keeps_entries_as_quantized_at_rest(
    bits, most, load_tiny, tmp_path
):
    """With ``bits``, an evicted entry is written as it rests in memory
    (quantized triples; sliding layers as quantized rings with their slack),
    read back as that entry and fetched dequantized: the working cache a
    fetch from memory gives, bit for bit, exact or trimmed back within the
    slack; the file's arrays at most 0.55x / 0.30x of a bfloat16 tier's."""
    from mlx_lm.models.cache import LRUPromptCache, RotatingKVCache
    from mlx_lm.models.prompt_cache_disk import DiskLRUPromptCache

    model, _ = load_tiny("gemma3_text", dtype="bfloat16", head_dim=64)
    first, second = PROMPT[:300], PROMPT[300:]
    stored = {}
    for name, at_rest in (("bf16", {}), ("quantized", {"bits": bits})):
        tier = disk(tmp_path / name)
        lru = DiskLRUPromptCache(tier, max_size=1, **at_rest)
        lru.insert_cache(MODEL, first, prefilled(model, first, slack=8))
        lru.insert_cache(
            MODEL, second, prefilled(model, second, slack=8)
        )  # evicts first
        tier.flush()
        # Written behind, both are on disk: the evicted one is first's (its
        # shared layers' blocks in block files, read with it).
        stored[name] = tier._load(tier._name(tier._model_key(MODEL), first))
        if at_rest:
            ram = LRUPromptCache(bits=bits)
            ram.insert_cache(MODEL, first, prefilled(model, first, slack=8))
            ram.trim_to(n_bytes=ram.nbytes - 1)  # at rest, as the tier wrote it
            for prompt in (first + EXTRA, first[:297] + EXTRA):
                got, rest = lru.fetch_nearest_cache(MODEL, prompt)
                want, _ = ram.fetch_nearest_cache(MODEL, prompt)
                assert rest == EXTRA and got[0].offset == len(prompt) - len(EXTRA)
                assert [type(c) for c in got] == [type(c) for c in want]
                assert {c.keys.dtype for c in got} == {mx.bfloat16}
                assert same(held(got), held(want))
        tier.close()
    kinds = [type(c).__name__ for c in stored["quantized"]]
    assert kinds == ["QuantizedRotatingKVCache", "QuantizedKVCache"] * 2
    nbytes = {k: sum(c.nbytes for c in v) for k, v in stored.items()}
    assert nbytes["quantized"] <= most * nbytes["bf16"]


def test_a_failed_write_is_warned_and_the_tier_goes_on(load_tiny, tmp_path, caplog):
    import shutil

    model, _ = load_tiny("llama")
    tier = disk(tmp_path / "gone")
    shutil.rmtree(tmp_path / "gone")  # every write now fails
    caplog.set_level(logging.WARNING)
    tier.put(MODEL, PROMPT, prefilled(model, PROMPT))
    tier.flush()
    assert "could not write" in caplog.text and len(tier) == 0

    os.makedirs(tmp_path / "gone")
    tier.put(MODEL, PROMPT, prefilled(model, PROMPT))
    tier.close()
    assert tier.get(MODEL, PROMPT + EXTRA)[1] == EXTRA
    (written,) = files(tmp_path / "gone")  # no temporary file left behind
    assert written.endswith(".safetensors")


# Hardening (#25): no file, swapped model or shared directory gives a wrong
# cache, an exception or a hang; each ends in a miss with a warning.


def read_header(path):
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def write_header(path, header, body, reseal=False, rename=False):
    """Write ``path`` with ``header``; with ``reseal`` its manifest digest
    recomputed (a crafted file), with ``rename`` named by its own hash.
    Returns the path written."""
    from mlx_lm.models.prompt_cache_disk import DiskPromptCache

    meta = header["__metadata__"]
    if reseal:
        meta["0.manifest"] = DiskPromptCache._manifest(header)
    if rename:
        tokens = json.loads(meta["0.tokens"]) if "0.tokens" in meta else None
        os.remove(path)
        path = path.parent / DiskPromptCache._name(meta["0.model"], tokens)
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + body)
    return path


def one_entry(model, directory, tokens=PROMPT[:90]):
    written(directory, (tokens, prefilled(model, tokens)))
    (name,) = [f for f in files(directory) if f.endswith(".safetensors")]
    return directory / name


def as_ints(header):
    for k, v in header.items():
        if k != "__metadata__" and v["dtype"] == "BF16":
            v["dtype"] = "I16"  # same size: the data reads as ints


def more_trimmable(header):
    header["__metadata__"]["0.trimmable"] = "150"  # a wrapped ring of 200


def other_tokens(header):
    header["__metadata__"]["0.tokens"] = json.dumps(PROMPT[:93])


# name: (edit, renamed to match the edit's hash, model family)
EDITS = {
    "floats read as ints": (as_ints, False, "llama"),
    "trim count raised": (more_trimmable, False, "llama_sliding"),
    "90 tokens claiming 93, renamed to their hash": (other_tokens, True, "llama"),
    "a class renamed": (
        lambda h: h["__metadata__"].update({"1.0": "QuantizedKVCache"}),
        False,
        "llama",
    ),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_header_is_a_miss_with_a_warning(edit, load_tiny, tmp_path, caplog):
    change, rename, family = EDITS[edit]
    model, _ = load_tiny(family, dtype="bfloat16")
    path = one_entry(
        model, tmp_path, PROMPT[:200] if "sliding" in family else PROMPT[:90]
    )
    header, body = read_header(path)
    change(header)
    path = write_header(path, header, body, rename=rename)
    caplog.set_level(logging.WARNING)

    tier = disk(tmp_path)

    assert len(tier) == 0
    assert f"skipping {path}: ValueError('its header does not match" in caplog.text
    assert tier.get(MODEL, PROMPT[:93] + EXTRA) is None


def test_a_resealed_header_claiming_other_tokens_is_a_miss(load_tiny, tmp_path, caplog):
    """Even with its manifest recomputed, a header claiming 93 tokens for a
    cache of 90 is not served: every layer must hold the tokens it names."""
    model, _ = load_tiny("llama")
    path = one_entry(model, tmp_path)
    header, body = read_header(path)
    other_tokens(header)
    path = write_header(path, header, body, reseal=True, rename=True)
    caplog.set_level(logging.WARNING)
    tier = disk(tmp_path)
    assert len(tier) == 1

    assert tier.get(MODEL, PROMPT[:93] + EXTRA) is None
    assert "holds 90 tokens, its header 93" in caplog.text and len(tier) == 0


CRAFTED = {
    "tokens null": {"0.tokens": "null"},
    "tokens nested": {"0.tokens": "[[1]]"},
    "tokens negative": {"0.tokens": "[-1]"},
    "model a list": {"0.model": ["a"]},
    "trim count a word": {"0.trimmable": "all"},
    "trim count past the tokens": {"0.trimmable": "1000"},
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_header_named_by_its_hash_is_skipped_not_raised(
    case, load_tiny, tmp_path, caplog
):
    model, _ = load_tiny("llama")
    path = one_entry(model, tmp_path)
    header, body = read_header(path)
    header["__metadata__"].update(CRAFTED[case])
    try:
        path = write_header(path, header, body, reseal=True, rename=True)
    except TypeError:  # a list as model cannot be hashed into a name
        path = write_header(path, header, body, reseal=True)
    caplog.set_level(logging.WARNING)

    tier = disk(tmp_path)

    assert len(tier) == 0 and f"skipping {path}" in caplog.text
    assert tier.get(MODEL, PROMPT[:90] + EXTRA) is None


ARRAY_ENTRIES = {
    "an array entry a list": lambda v: [v["dtype"], v["shape"]],
    "a dimension a float": lambda v: {**v, "shape": [float(d) for d in v["shape"]]},
    "a dimension negative": lambda v: {**v, "shape": [-1] + v["shape"][1:]},
    "an offset a bool": lambda v: {**v, "data_offsets": [False, 1]},
    "an unknown dtype": lambda v: {**v, "dtype": "C64"},
}


@pytest.mark.parametrize("case", list(ARRAY_ENTRIES))
def test_a_crafted_array_entry_is_a_value_error_naming_it(
    case, load_tiny, tmp_path, caplog
):
    """Each array's entry in a resealed header is checked for its kind
    before it is used: a ``ValueError`` naming the array, never another
    exception (a list in place of a dict raised ``AttributeError``)."""
    model, _ = load_tiny("llama")
    path = one_entry(model, tmp_path)
    header, body = read_header(path)
    header["0.0"] = ARRAY_ENTRIES[case](header["0.0"])
    path = write_header(path, header, body, reseal=True)
    caplog.set_level(logging.WARNING)

    tier = disk(tmp_path)

    assert len(tier) == 0
    why = "ValueError(\"array '0.0' has a malformed dtype, shape or offsets\")"
    assert f"skipping {path}: {why}" in caplog.text


def test_fifos_links_and_huge_headers_are_never_opened_or_read_whole(
    load_tiny, tmp_path, caplog
):
    model, _ = load_tiny("llama")
    path = one_entry(model, tmp_path / "tier", PROMPT[:90])
    tier_dir = path.parent
    fifo = tier_dir / ("a" * 32 + ".safetensors")
    os.mkfifo(fifo)  # opened, it would block the scan forever
    os.mkfifo(tier_dir / "notes.fifo")
    link = tier_dir / ("b" * 32 + ".safetensors")
    os.symlink(path, link)
    sparse = tier_dir / ("c" * 32 + ".safetensors")
    with open(sparse, "wb") as f:  # 3 GiB, claiming a 3 GiB header
        f.write((3 << 30).to_bytes(8, "little"))
        f.truncate(3 << 30)
    caplog.set_level(logging.WARNING)

    tier = disk(tier_dir)

    assert len(tier) == 1 and tier.get(MODEL, PROMPT[:90] + EXTRA)[1] == EXTRA
    for p in (fifo, tier_dir / "notes.fifo", link):
        assert f"skipping {p}: ValueError('not a regular file')" in caplog.text
    assert f"skipping {sparse}: ValueError('a header of {3 << 30} bytes" in caplog.text


def test_other_weights_at_the_same_path_are_a_miss(make_tiny_dir, tmp_path):
    import shutil

    from mlx_lm.utils import load

    source = make_tiny_dir("llama")
    model_dir = tmp_path / "model"
    shutil.copytree(source, model_dir)
    key = (str(model_dir), None, None)
    model, _ = load(str(model_dir))
    tier = disk(tmp_path / "tier")
    tier.put(key, PROMPT, prefilled(model, PROMPT))
    tier.close()

    assert disk(tmp_path / "tier").get(key, PROMPT + EXTRA)[1] == EXTRA
    # The same files elsewhere: the same weights, a hit.
    shutil.copytree(model_dir, tmp_path / "copy")
    copied = (str(tmp_path / "copy"), None, None)
    assert disk(tmp_path / "tier").get(copied, PROMPT + EXTRA)[1] == EXTRA
    # New weights, same config, same path: a miss.
    other = make_tiny_dir("llama", seed=5)
    shutil.copy(other / "model.safetensors", model_dir / "model.safetensors")
    assert disk(tmp_path / "tier").get(key, PROMPT + EXTRA) is None


def test_an_entry_unlike_the_models_own_caches_is_a_miss(load_tiny, tmp_path, caplog):
    model, _ = load_tiny("llama")
    other, _ = load_tiny("llama", head_dim=32, num_hidden_layers=2)
    written(tmp_path, (PROMPT, prefilled(model, PROMPT)))
    tier = disk(tmp_path)
    tier.learn(MODEL, prefilled(other, PROMPT[:3]))
    caplog.set_level(logging.WARNING)

    assert tier.get(MODEL, PROMPT + EXTRA) is None
    assert "it has 4 layers, the model 2" in caplog.text


def test_replicas_on_one_directory_hold_its_budget_together(
    load_tiny, tmp_path, caplog
):
    model, _ = load_tiny("llama")
    prompts = [[t] + PROMPT[:200] for t in range(1, 9)]
    one = written(tmp_path / "one", (prompts[0], prefilled(model, prompts[0]))).nbytes
    budget = 3 * one + one // 2
    replicas = [disk(tmp_path / "tier", budget) for _ in range(2)]
    caplog.set_level(logging.WARNING)
    for i, tokens in enumerate(prompts):
        replicas[i % 2].put(MODEL, tokens, prefilled(model, tokens))
        replicas[i % 2].flush()
    for r in replicas:
        r.close()

    sizes = [os.path.getsize(tmp_path / "tier" / f) for f in files(tmp_path / "tier")]
    assert sum(sizes) <= budget and len(sizes) == 3
    assert "could not remove" not in caplog.text
    # The newest three, whichever replica wrote them.
    restarted = disk(tmp_path / "tier", budget)
    assert [restarted.get(MODEL, p + EXTRA) is not None for p in prompts] == [
        False
    ] * 5 + [True] * 3


def test_temporary_files_a_killed_writer_left_are_removed_on_the_next_scan(
    tmp_path,
):
    import fcntl

    from mlx_lm.models.prompt_cache_disk import DiskPromptCache

    stale = tmp_path / ("d" * 32 + ".safetensors.999999-1.tmp")
    held = tmp_path / ("e" * 32 + ".safetensors.999998-1.tmp")
    stale.write_bytes(b"x" * 1000)
    held.write_bytes(b"x" * 1000)
    past = os.path.getmtime(stale) - 2 * DiskPromptCache.temp_grace
    for p in (stale, held):
        os.utime(p, (past, past))
    with open(held, "rb") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # its writer is still writing
        disk(tmp_path).close()
        assert not stale.exists() and held.exists()


def test_a_full_disk_evicts_the_oldest_entries_and_writing_goes_on(load_tiny, tmp_path):
    import subprocess

    model, _ = load_tiny("llama")
    prompts = [[t] + PROMPT[:200] for t in range(1, 5)]
    one = written(tmp_path / "one", (prompts[0], prefilled(model, prompts[0]))).nbytes
    small = tmp_path / "small"
    small.mkdir()
    size = (5 * one // 2) // 4096 * 4096  # room for two entries, not three
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(small)]
    if os.geteuid() != 0 or subprocess.run(mount, capture_output=True).returncode:
        pytest.skip("needs a small file system: root may mount a tmpfs")
    try:
        tier = disk(small)  # no byte budget: only the disk bounds it
        for tokens in prompts:
            tier.put(MODEL, tokens, prefilled(model, tokens))
            tier.flush()
        tier.close()
        assert [tier.get(MODEL, p + EXTRA) is not None for p in prompts] == [
            False,
            False,
            True,
            True,
        ]
        assert all(f.endswith(".safetensors") for f in files(small))
    finally:
        subprocess.run(["umount", "-l", str(small)], check=True)


# Write-behind (#27): put queues the entry's own arrays and returns; the
# writer thread copies them to host. A test holds the directory's lock to
# keep an entry queued: the writer waits for it before renaming the file.


class DirectoryHeld:
    """The directory's ``flock``, held: queued entries stay queued."""

    def __init__(self, directory):
        import fcntl

        self.fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self):
        os.close(self.fd)


def test_put_queues_the_caches_own_buffers_not_a_host_copy(load_tiny, tmp_path):
    import numpy as np

    model, _ = load_tiny("llama", dtype="bfloat16")
    cache = prefilled(model, PROMPT)
    lru = disk_lru(tmp_path, max_size=1)
    # Layers whole: an entry sharing prefix blocks (prompt_cache_blocks) is
    # joined once for the disk, on put's thread (lazily: only if not queued
    # or written already).
    lru._blocks.block_size = len(PROMPT) + 1
    lru.insert_cache(MODEL, PROMPT, cache)
    (entry,) = [lru._trie.get(MODEL, PROMPT)]
    (state,) = lru.disk._pending.values()

    def address(a):
        return np.asarray(
            a.view(mx.uint16) if a.dtype == mx.bfloat16 else a
        ).ctypes.data

    arrays = [a for c in entry.prompt_cache for a in c.state if isinstance(a, mx.array)]
    shared = {address(a) for a in arrays}
    assert len(shared) == 2 * len(cache)  # keys and values of every layer
    # The buffers memory holds, not copies.
    assert shared <= {address(a) for a in state.arrays.values()}
    lru.disk.close()


def disk_lru(directory, max_size=10, **kwargs):
    from mlx_lm.models.prompt_cache_disk import DiskLRUPromptCache

    return DiskLRUPromptCache(disk(directory, **kwargs), max_size=max_size)


def test_a_queued_entry_is_served_before_its_file_exists(load_tiny, tmp_path):
    model, _ = load_tiny("llama", dtype="bfloat16")
    cache = prefilled(model, PROMPT)
    kept = copy.deepcopy(cache)
    tier = disk(tmp_path)
    lock = DirectoryHeld(tmp_path)
    try:
        tier.put(MODEL, PROMPT, cache)
        model(mx.array(EXTRA)[None], cache=cache)  # the caller goes on using it
        restored, rest = tier.get(MODEL, PROMPT + EXTRA)
        assert tier.queued == 1
        assert not [f for f in files(tmp_path) if f.endswith(".safetensors")]
    finally:
        lock.release()
    assert rest == EXTRA and same(live(restored), live(kept))
    tier.close()
    restored, rest = disk(tmp_path).get(MODEL, PROMPT + EXTRA)
    assert rest == EXTRA and same(live(restored), live(kept))


def test_a_full_queue_drops_the_entry_and_counts_it(
    load_tiny, tmp_path, caplog, monkeypatch
):
    """An entry the queue cannot take is dropped, counted and warned, its
    state never made (a view and a schedule an array, on the serving
    thread): only the entry queued is."""
    from mlx_lm.models import prompt_cache_disk
    from mlx_lm.models.cache import prompt_cache_state

    model, _ = load_tiny("llama")
    prompts = [[t] + PROMPT[:200] for t in (1, 2, 4)]
    caches = [prefilled(model, p) for p in prompts]
    one = prompt_cache_state(caches[0]).nbytes  # what the queue holds of one
    tier = disk(tmp_path, queue_bytes=one + one // 2)
    made = []
    monkeypatch.setattr(
        prompt_cache_disk,
        "prompt_cache_state",
        lambda *a: made.append(1) or prompt_cache_state(*a),
    )
    caplog.set_level(logging.WARNING)
    lock = DirectoryHeld(tmp_path)
    try:
        for tokens, cache in zip(prompts, caches):
            tier.put(MODEL, tokens, cache)
    finally:
        lock.release()
    tier.close()

    assert tier.dropped == 2 and len(made) == 1
    assert "2 dropped so far" in caplog.text
    assert [tier.get(MODEL, p + EXTRA) is not None for p in prompts] == [
        True,
        False,
        False,
    ]


def test_an_entry_on_disk_is_not_written_again_when_memory_evicts_it(
    load_tiny, tmp_path
):
    model, _ = load_tiny("llama")
    first, second = PROMPT[:300], PROMPT[300:]
    lru = disk_lru(tmp_path, max_size=1)
    lru.insert_cache(MODEL, first, prefilled(model, first))
    lru.disk.flush()
    (name,) = files(tmp_path)
    before = os.stat(tmp_path / name)
    # Writes happen as entries are stored: the second is queued, the first
    # (evicted by it) is not queued again.
    lock = DirectoryHeld(tmp_path)
    try:
        lru.insert_cache(MODEL, second, prefilled(model, second))
        assert lru.disk.queued == 1 and len(lru) == 1
    finally:
        lock.release()
    lru.disk.close()
    after = os.stat(tmp_path / name)
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert len(files(tmp_path)) == 2


def test_close_with_a_timeout_gives_up_on_what_is_left_and_says_so(
    load_tiny, tmp_path, caplog
):
    model, _ = load_tiny("llama")
    prompts = [[t] + PROMPT[:100] for t in (1, 2)]
    tier = disk(tmp_path)
    caplog.set_level(logging.WARNING)
    lock = DirectoryHeld(tmp_path)
    try:
        for tokens in prompts:
            tier.put(MODEL, tokens, prefilled(model, tokens))
        assert tier.close(timeout=0.2) == 2
        assert "2 entries" in caplog.text and "the 0.2 s to write them ran out" in (
            caplog.text
        )
        with pytest.raises(ValueError, match="after close"):
            tier.put(MODEL, PROMPT, prefilled(model, PROMPT))
    finally:
        lock.release()
    tier._writer.join(30)
    # The file being written when time ran out is finished, the rest is not.
    assert len(files(tmp_path)) == 1 and all(
        f.endswith(".safetensors") for f in files(tmp_path)
    )


def test_a_replica_finds_what_another_wrote_after_it_started(load_tiny, tmp_path):
    from mlx_lm.models.prompt_cache_disk import DiskLRUPromptCache

    model, _ = load_tiny("llama")
    # Memory keeps nothing (a disk hit stays there too): every fetch asks disk.
    reader = DiskLRUPromptCache(disk(tmp_path), max_size=0)
    assert reader.fetch_nearest_cache(MODEL, PROMPT + EXTRA) == (None, PROMPT + EXTRA)
    written(tmp_path, (PROMPT, prefilled(model, PROMPT)))

    cache, rest = reader.fetch_nearest_cache(MODEL, PROMPT + EXTRA)
    assert rest == EXTRA and same(live(cache), live(prefilled(model, PROMPT)))
    for f in files(tmp_path):  # the other replica's budget removed it
        os.remove(tmp_path / f)
    os.utime(tmp_path, ns=(0, 0))  # a changed directory, on any clock
    assert reader.fetch_nearest_cache(MODEL, PROMPT + EXTRA) == (None, PROMPT + EXTRA)
    assert len(reader.disk) == 0


def test_entries_of_another_scope_are_other_entries(load_tiny, tmp_path):
    """A server's --kv-bits is in every key: a server quantizing otherwise
    never gets them."""
    model, _ = load_tiny("llama")

    def scoped(scope):
        tier = disk(tmp_path)
        tier.scope = scope
        return tier

    writer = scoped("--kv-bits 8")
    writer.put(MODEL, PROMPT, prefilled(model, PROMPT, kv_bits=8))
    writer.close()

    assert scoped("--kv-bits 4").get(MODEL, PROMPT + EXTRA) is None
    assert scoped(None).get(MODEL, PROMPT + EXTRA) is None
    assert scoped("--kv-bits 8").get(MODEL, PROMPT + EXTRA)[1] == EXTRA


# Restore that beats recompute (#27): entries read in parallel chunks, each
# chunk's CRC-32 joined; a cost model restores only what reading saves.


def test_chunk_crcs_joined_are_zlibs_crc32_of_the_whole():
    import random
    import zlib

    from mlx_lm.models.prompt_cache_disk import DiskPromptCache as D

    rng = random.Random(0)
    for _ in range(50):
        a, b = (rng.randbytes(rng.randint(0, 5000)) for _ in range(2))
        joined = D._crc32_times(D._crc32_shift(len(b)), zlib.crc32(a)) ^ zlib.crc32(b)
        assert joined == zlib.crc32(a + b)


@pytest.mark.parametrize("chunk,threads", [(1000, 3), (4096, 1)])
def test_an_entry_read_in_small_chunks_is_bit_exact_and_a_flipped_bit_is_refused(
    chunk, threads, load_tiny, tmp_path, caplog
):
    model, _ = load_tiny("llama")
    cache = prefilled(model, PROMPT)
    path = one_entry(model, tmp_path, PROMPT)
    tier = disk(tmp_path)
    tier.read_chunk, tier.read_threads = chunk, threads
    assert os.path.getsize(path) > 20 * chunk  # many chunks, several arrays

    restored, rest = tier.get(MODEL, PROMPT + EXTRA)
    assert rest == EXTRA and same(live(restored), live(cache))

    with open(path, "r+b") as f:  # one bit, in the middle of the data
        f.seek(os.path.getsize(path) // 2 + 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 16]))
    caplog.set_level(logging.WARNING)
    assert tier.get(MODEL, PROMPT + EXTRA) is None
    assert f"{path}: ValueError('its data does not match its CRC-32')" in caplog.text


def test_a_file_of_arrays_in_another_order_is_read_array_by_array(
    load_tiny, tmp_path, caplog
):
    """Files written before arrays went in sorted key order (one CRC-32 run
    over the data) are read with the CRC-32 joined array by array."""
    model, _ = load_tiny("llama")
    cache = prefilled(model, PROMPT)
    path = one_entry(model, tmp_path, PROMPT)
    header, body = read_header(path)
    keys = sorted((k for k in header if k != "__metadata__"), reverse=True)
    parts, at = [], 0
    for k in keys:
        start, stop = header[k]["data_offsets"]
        parts.append(body[start:stop])
        header[k]["data_offsets"] = [at, at + stop - start]
        at += stop - start
    path = write_header(path, header, b"".join(parts), reseal=True)

    restored, rest = disk(tmp_path).get(MODEL, PROMPT + EXTRA)
    assert rest == EXTRA and same(live(restored), live(cache))
    parts[-1] = bytes([parts[-1][0] ^ 1]) + parts[-1][1:]  # the first key's
    path = write_header(path, header, b"".join(parts))
    caplog.set_level(logging.WARNING)
    assert disk(tmp_path).get(MODEL, PROMPT + EXTRA) is None
    assert "its data does not match its CRC-32" in caplog.text


def restores(tier, cached=0, prefill_rate=None, read_rate=1e6):
    """A ``DiskLRUPromptCache`` on ``tier`` that measured ``prefill_rate``
    tokens a second and ``read_rate`` bytes a second: fixed numbers."""
    from mlx_lm.models.prompt_cache_disk import DiskLRUPromptCache

    lru = DiskLRUPromptCache(tier)
    tier._read = [read_rate, 1.0]
    lru._prefill = [0, 0.0] if prefill_rate is None else [prefill_rate, 1.0]
    return lru


def test_cost_model_restores_what_saves_time_and_recomputes_otherwise(
    load_tiny, tmp_path
):
    """Stored: 100 and 500 tokens of PROMPT; asked: 120 of them. Reading a
    file of b bytes at R bytes/s saves (n / rate - b / R) seconds; the
    option that saves the most is taken, none if none saves."""
    model, _ = load_tiny("llama")
    short, long = PROMPT[:100], PROMPT
    written(tmp_path, (short, prefilled(model, short)), (long, prefilled(model, long)))
    tier = disk(tmp_path)
    b_short, b_long = (
        tier._files[tier._name(repr(MODEL), t)][3] for t in (short, long)
    )
    prompt, R = PROMPT[:120] + EXTRA, 1e6
    # Seconds a token of prefill takes where the short file starts to pay,
    # and where the long one, trimmed to 120, pays more than the short one.
    pays = b_short / R / 100
    beats = (b_long - b_short) / R / 20
    assert pays < beats

    def served(seconds_per_token):
        lru = restores(tier, prefill_rate=1 / seconds_per_token, read_rate=R)
        cache, rest = lru.fetch_nearest_cache(MODEL, prompt)
        return 0 if cache is None else cache[0].offset, len(rest)

    assert served(pays / 2) == (0, len(prompt))  # recompute
    assert served((pays + beats) / 2) == (100, len(prompt) - 100)  # the shorter
    assert served(2 * beats) == (120, len(EXTRA))  # the longer, trimmed
    # No prefill measured yet: the entry reusing the most, as before.
    assert restores(tier).fetch_nearest_cache(MODEL, prompt)[0][0].offset == 120
    # What memory holds counts: the short file saves nothing over it.
    lru = restores(tier, prefill_rate=1 / ((pays + beats) / 2), read_rate=R)
    lru.insert_cache(MODEL, short, prefilled(model, short))
    assert lru.fetch_nearest_cache(MODEL, prompt)[1] == prompt[100:]


def test_memory_leaving_the_last_token_asks_nothing_of_the_disk(
    load_tiny, tmp_path, monkeypatch
):
    """A prompt sent again hits memory for all but its last token, which is
    prefilled whatever the disk holds: the tier is not asked (its lookup
    walked and hashed the whole prompt: ~100 ms for 24k tokens on a GPU
    host); with two tokens left it is."""
    model, _ = load_tiny("llama")
    written(tmp_path, (PROMPT, prefilled(model, PROMPT)))
    tier = disk(tmp_path)
    asked = []
    get = tier.get
    monkeypatch.setattr(tier, "get", lambda *a, **k: asked.append(a) or get(*a, **k))
    lru = restores(tier)
    lru.insert_cache(MODEL, PROMPT[:-2], prefilled(model, PROMPT[:-2]))
    assert lru.fetch_nearest_cache(MODEL, PROMPT)[1] == []  # the disk: it all
    assert len(asked) == 1
    lru.insert_cache(MODEL, PROMPT[:-1], prefilled(model, PROMPT[:-1]))
    assert lru.fetch_nearest_cache(MODEL, PROMPT[:-1] + [7])[1] == [7]
    assert len(asked) == 1


def test_a_forced_recompute_gives_the_same_tokens_as_a_restore(load_tiny, tmp_path):
    model, _ = load_tiny("llama")
    written(tmp_path, (PROMPT, prefilled(model, PROMPT)))
    prompt = PROMPT + EXTRA

    cache, rest = restores(disk(tmp_path)).fetch_nearest_cache(MODEL, prompt)
    assert rest == EXTRA
    restored = single_stream(model, rest, STEPS, cache=cache)[0]
    # Prefill measured at a billion tokens a second: recomputing is cheaper.
    slow_disk = restores(disk(tmp_path), prefill_rate=1e9)
    assert slow_disk.fetch_nearest_cache(MODEL, prompt) == (None, prompt)
    assert single_stream(model, prompt, STEPS)[0] == restored


def test_a_restarted_tier_starts_from_the_rates_measured_before(load_tiny, tmp_path):
    """Read and prefill rates are kept in the directory: after a restart the
    cost model recomputes what it measured slower to read, where without
    them it would restore it (no prefill rate known)."""
    from mlx_lm.models.prompt_cache_disk import DiskLRUPromptCache

    model, _ = load_tiny("llama")
    written(tmp_path, (PROMPT, prefilled(model, PROMPT)))
    lru = DiskLRUPromptCache(disk(tmp_path))
    assert lru.fetch_nearest_cache(MODEL, PROMPT + EXTRA)[1] == EXTRA  # restored
    lru.observe_prefill(10**9, 1.0)  # a billion tokens a second
    read = lru.disk.read_rate
    lru.disk.close()

    again = DiskLRUPromptCache(disk(tmp_path))
    assert again.prefill_rate == 10**9  # kept by close, within rates_every
    assert again.disk.read_rate == read
    assert again.fetch_nearest_cache(MODEL, PROMPT + EXTRA) == (None, PROMPT + EXTRA)
    for bad in ['{"read": [1e999, 1], "prefill": ["9", 1]}', "[", '{"read": 3}']:
        (tmp_path / ".rates.json").write_text(bad)
        fresh = DiskLRUPromptCache(disk(tmp_path))
        assert fresh.prefill_rate is None and fresh.disk.read_rate == 2e9


def test_probe_read_measures_the_smallest_entry_worth_a_rate_once(
    load_tiny, tmp_path, monkeypatch
):
    """A restarted tier that never measured a restore reads one entry of
    ``read_min_bytes`` or more (the smallest) and keeps its rate; one that
    measured a rate, or holds no entry that large, reads nothing."""
    from mlx_lm.models.prompt_cache_disk import DiskPromptCache

    model, _ = load_tiny("llama")
    short, long = PROMPT[:100], PROMPT
    written(tmp_path, (short, prefilled(model, short)), (long, prefilled(model, long)))
    tier = disk(tmp_path)
    sizes = sorted(tier._entry_bytes(name) for name in tier._files)
    loads = []
    load = tier._load
    monkeypatch.setattr(tier, "_load", lambda name: loads.append(name) or load(name))
    monkeypatch.setattr(DiskPromptCache, "read_min_bytes", sizes[1] + 1)
    assert tier.probe_read() is False and loads == []
    assert tier.read_rate == tier.read_prior

    monkeypatch.setattr(DiskPromptCache, "read_min_bytes", sizes[0])
    assert tier.probe_read() is True and len(loads) == 1
    assert tier.last_read[0] == sizes[0]  # the shorter entry's
    assert tier.read_rate == sizes[0] / tier.last_read[1] != tier.read_prior
    assert tier.probe_read() is False and len(loads) == 1
    tier.close()
    assert disk(tmp_path).probe_read() is False  # the rate kept in the directory


def test_prefill_rate_is_read_from_a_batch_generators_counters(tmp_path):
    from mlx_lm.generate_utils import BatchCounters

    lru = restores(disk(tmp_path))
    assert lru.prefill_rate is None
    counters = BatchCounters()
    lru.prefill_counters = counters
    counters.prompt_tokens, counters.prompt_time = 3000, 2.0
    assert lru.prefill_rate == 1500
    # 1000 more in a second: the totals so far weigh half
    counters.prompt_tokens, counters.prompt_time = 4000, 3.0
    assert lru.prefill_rate == (3000 / 2 + 1000) / (2.0 / 2 + 1.0)
    lru.prefill_counters = BatchCounters()  # a new generator counts from 0
    lru.prefill_counters.prompt_tokens, lru.prefill_counters.prompt_time = 260, 1.0
    assert lru.prefill_rate == (2500 / 2 + 260) / (2.0 / 2 + 1.0)
    assert lru.prefill_rate == 755  # read once: nothing counted twice
    # A short prefill teaches it nothing: its fixed costs are not a rate
    lru.prefill_counters.prompt_tokens, lru.prefill_counters.prompt_time = 290, 2.0
    assert lru.prefill_rate == 755


def test_a_prefill_counts_when_its_cache_is_stored(load_tiny, tmp_path):
    """A server's prefill is in the rates its directory keeps once its cache
    is stored, not at a next request: a server stopped after one long
    prompt kept no prefill rate, and the restarted one restored a 4-bit
    24k-token entry in 8 s where the prefill took 2.5 s."""
    from mlx_lm.generate_utils import BatchCounters
    from mlx_lm.models.prompt_cache_disk import DiskLRUPromptCache

    model, _ = load_tiny("llama")
    lru = DiskLRUPromptCache(disk(tmp_path))
    lru.prefill_counters = counters = BatchCounters()
    counters.prompt_tokens, counters.prompt_time = len(PROMPT), 0.5  # its prefill
    lru.insert_cache(MODEL, PROMPT, prefilled(model, PROMPT))
    lru.disk.close()
    assert DiskLRUPromptCache(disk(tmp_path)).prefill_rate == len(PROMPT) / 0.5


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("value", [float("nan"), float("-inf")])
def test_a_resealed_file_holding_nan_or_inf_is_a_miss(
    dtype, value, load_tiny, tmp_path, caplog
):
    """The reader checks floats as it reads them: a file whose CRC-32 and
    manifest were recomputed around a NaN (or infinity) is still refused."""
    import zlib

    model, _ = load_tiny("llama", dtype=dtype)
    path = one_entry(model, tmp_path)
    header, body = read_header(path)
    size = getattr(mx, dtype).size
    bad = mx.array([value], getattr(mx, dtype)).view(getattr(mx, f"uint{8 * size}"))
    start = header["1.0"]["data_offsets"][0] + 7 * size  # layer 1's keys, 8th
    body = body[:start] + bad.item().to_bytes(size, "little") + body[start + size :]
    crc = 0
    for k in sorted(k for k in header if k != "__metadata__"):
        a, b = header[k]["data_offsets"]
        crc = zlib.crc32(body[a:b], crc)
    header["__metadata__"]["0.crc32"] = str(crc)
    path = write_header(path, header, body, reseal=True)
    caplog.set_level(logging.WARNING)
    tier = disk(tmp_path)
    assert len(tier) == 1

    assert tier.get(MODEL, PROMPT[:90] + EXTRA) is None
    assert f"{path}: ValueError('array 1.0 holds NaN or infinite" in caplog.text
    assert len(tier) == 0


@pytest.mark.parametrize("chunk", [4, 1 << 20])
@pytest.mark.parametrize("before", [2, 3])
def test_the_reader_names_the_array_holding_a_nan_in_any_read_or_offset(
    before, chunk, tmp_path
):
    """Float arrays are checked by the threads as they read them, a run of
    ``read_chunk`` bytes at a time (4: each bfloat16 array spans runs), and
    one at an offset that is not a multiple of its item size (3), after:
    either way the array holding the NaN is named, and the same file
    without it reads back whole."""
    import zlib

    tier = disk(tmp_path)
    tier.read_chunk = chunk
    nan = mx.array([float("nan")], mx.bfloat16).view(mx.uint16).item()
    for bad in (None, "b"):
        arrays = {"a": bytes(range(1, before + 1))}
        for k in "bc":  # 1.0 2.0 3.0 4.0 in bfloat16, one a NaN in "b"
            words = [0x3F80, 0x4000, nan if k == bad else 0x4040, 0x4080]
            arrays[k] = b"".join(w.to_bytes(2, "little") for w in words)
        header, at = {}, 0
        for k, dtype in zip("abc", ["U8", "BF16", "BF16"]):
            n = len(arrays[k])
            shape = [n // (1 if dtype == "U8" else 2)]
            header[k] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
            at += n
        body = b"".join(arrays[k] for k in "abc")
        header["__metadata__"] = {"0.crc32": str(zlib.crc32(body))}
        header["__metadata__"]["0.manifest"] = tier._manifest(header)
        text = json.dumps(header).encode()
        path = tmp_path / f"{bad}.safetensors"
        path.write_bytes(len(text).to_bytes(8, "little") + text + body)
        fd = os.open(path, os.O_RDONLY)
        try:
            checked, _ = tier._safetensors_header(fd)
            if bad is None:
                assert tier._read_arrays(fd, checked).tobytes() == body
            else:
                with pytest.raises(ValueError, match="array b holds NaN"):
                    tier._read_arrays(fd, checked)
        finally:
            os.close(fd)
    tier.close()


# Hardening, second round (#48): the writer never dies, every queued entry is
# written or counted as dropped; an entry file of another kind is a miss that
# the next write replaces.


def test_an_entry_put_again_while_queued_is_written_once_and_the_writer_goes_on(
    load_tiny, tmp_path
):
    """A queued entry the index dropped (a ``get`` refused its cache: here
    the model's caches are learned with one kv head) and put again: it is written
    once, and so is the entry queued after it. Before, it was queued twice
    and the second ``_pending[name]`` raised ``KeyError`` outside the
    writer's ``try``: the thread died and nothing was written after it."""
    model, _ = load_tiny("llama")
    other, _ = load_tiny("llama", num_key_value_heads=1)
    x, y = ([t] + PROMPT[:100] for t in (1, 2))
    tier = disk(tmp_path)
    tier.learn(MODEL, prefilled(other, x))
    lock = DirectoryHeld(tmp_path)
    try:
        tier.put(MODEL, x, prefilled(model, x))
        assert tier.get(MODEL, x + EXTRA) is None  # refused: not its layout
        tier.put(MODEL, x, prefilled(model, x))
        tier.put(MODEL, y, prefilled(model, y))
    finally:
        lock.release()
    assert tier.close(timeout=60) == 0
    assert not tier._writer.is_alive() and tier.queued == tier.queued_bytes == 0
    assert (tier.written, tier.dropped) == (2, 0)
    assert len(files(tmp_path)) == 2


def test_a_replica_evicting_a_file_another_has_queued_loses_no_write(
    load_tiny, tmp_path, caplog
):
    """Replica ``b`` queues ``x`` while ``x``'s file (replica ``a``'s) is on
    disk; ``b``'s budget pass for the entry before evicts that file. Before,
    it took ``x`` out of ``b``'s index too, and the write of ``x`` failed:
    ``could not write ...: KeyError``."""
    model, _ = load_tiny("llama")
    x, y = ([t] + PROMPT[:200] for t in (1, 2))
    one = written(tmp_path / "one", (x, prefilled(model, x))).nbytes
    shared = tmp_path / "tier"
    b = disk(shared, max_bytes=one + one // 2)
    written(shared, (x, prefilled(model, x)))  # replica a
    caplog.set_level(logging.WARNING)
    lock = DirectoryHeld(shared)
    try:
        b.put(MODEL, y, prefilled(model, y))
        b.put(MODEL, x, prefilled(model, x))  # on disk, not in b's index
    finally:
        lock.release()
    b.close()
    assert "could not write" not in caplog.text
    assert (b.written, b.dropped) == (2, 0)
    assert disk(shared).get(MODEL, x + EXTRA)[1] == EXTRA


def test_the_writer_survives_any_error_and_counts_the_entry_dropped(
    load_tiny, tmp_path, caplog, monkeypatch
):
    """An exception the writer does not expect (here: the state of a queued
    entry cannot be copied to host) is warned once, naming the entry, and
    counted; the next entry is written."""
    from mlx_lm.models import prompt_cache_disk

    model, _ = load_tiny("llama")
    x, y = ([t] + PROMPT[:100] for t in (1, 2))
    tier = disk(tmp_path)
    caplog.set_level(logging.WARNING)
    own, broken = prompt_cache_disk._own_copies, []

    def first_broken(state):
        copied = own(state)
        if not broken:
            broken.append(copied)
            copied.arrays = None  # nothing to copy: TypeError in the writer
        return copied

    monkeypatch.setattr(prompt_cache_disk, "_own_copies", first_broken)
    lock = DirectoryHeld(tmp_path)
    try:
        tier.put(MODEL, x, prefilled(model, x))
        tier.put(MODEL, y, prefilled(model, y))
    finally:
        lock.release()
    assert tier.close(timeout=60) == 0
    name = tier._name(tier._model_key(MODEL), x)
    assert caplog.text.count(f"could not write {name}") == 1
    assert (tier.written, tier.dropped) == (1, 1) and tier.queued_bytes == 0
    assert tier.get(MODEL, x + EXTRA) is None
    assert tier.get(MODEL, y + EXTRA)[1] == EXTRA


def entry_replaced_by(kind, path):
    os.remove(path)
    if kind == "directory":
        os.mkdir(path)
        (path / "inside").write_bytes(b"x")
    elif kind == "link to /dev/zero":
        os.symlink("/dev/zero", path)
    elif kind == "fifo":
        os.mkfifo(path)


@pytest.mark.parametrize("kind", ["directory", "link to /dev/zero", "fifo"])
def test_an_entry_file_of_another_kind_is_a_miss_and_written_again(
    kind, load_tiny, tmp_path, caplog
):
    """An indexed entry's file replaced by a directory, a link or a FIFO: a
    miss with a warning, set aside, and the next write of the entry puts it
    back (before, a directory stayed and every write of it failed)."""
    model, _ = load_tiny("llama")
    tokens = PROMPT[:100]
    tier = disk(tmp_path)
    tier.put(MODEL, tokens, prefilled(model, tokens))
    tier.flush()
    (name,) = files(tmp_path)
    entry_replaced_by(kind, tmp_path / name)
    caplog.set_level(logging.WARNING)
    assert tier.get(MODEL, tokens + EXTRA) is None
    assert f"skipping {tmp_path / name}" in caplog.text
    tier.put(MODEL, tokens, prefilled(model, tokens))
    tier.close()
    assert "could not write" not in caplog.text
    assert os.path.isfile(tmp_path / name) and not os.path.islink(tmp_path / name)
    assert disk(tmp_path).get(MODEL, tokens + EXTRA)[1] == EXTRA


def test_a_servers_tier_never_waits_for_the_weights_digest_and_keeps_it(
    make_tiny_dir, tmp_path, monkeypatch
):
    """With ``digest_wait=False`` (the server's) a put or get before the
    model directory's digest is known returns at once, writing and serving
    nothing; the digest read is kept in the directory, so a restarted tier
    knows it without reading the weights again."""
    from mlx_lm.utils import load

    model_dir = make_tiny_dir("llama")
    key = (str(model_dir), None, None)
    model, _ = load(str(model_dir))
    tier = disk(tmp_path, digest_wait=False)
    reading = threading.Event()
    original = tier._digest

    def slow(directory, wait=True):  # the thread reading the weights, held
        if wait:
            reading.wait(30)
        return original(directory, wait)

    monkeypatch.setattr(tier, "_digest", slow)
    tier.put(key, PROMPT, prefilled(model, PROMPT))
    assert tier.get(key, PROMPT + EXTRA) is None and tier.queued == 0
    reading.set()
    while tier._model_key(key, wait=False) is None:
        time.sleep(0.01)
    tier.put(key, PROMPT, prefilled(model, PROMPT))
    tier.close()

    restarted = disk(tmp_path, digest_wait=False)
    module = sys.modules["mlx_lm.models.prompt_cache_dir"]
    monkeypatch.setattr(module, "_file_digest", None)  # no file read again
    assert restarted.get(key, PROMPT + EXTRA)[1] == EXTRA
    restarted.close()


def test_a_weights_digest_covers_every_byte_of_every_run(tmp_path):
    """The weights' digest, hashed in runs on several threads, is the same
    for the same bytes anywhere and changes with any byte flipped, in the
    first run, across a run's edge or in the last, short one, and with the
    length."""
    from mlx_lm.models.prompt_cache_dir import _file_digest

    data = bytearray(os.urandom(10_007))
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(data)
    b.write_bytes(data)
    seen = {_file_digest(str(a), 1000)}
    assert _file_digest(str(b), 1000) in seen
    for i in (0, 999, 1000, 5500, len(data) - 1):
        data[i] ^= 1
        b.write_bytes(data)
        seen.add(_file_digest(str(b), 1000))
        data[i] ^= 1
    b.write_bytes(data + b"\0")
    seen.add(_file_digest(str(b), 1000))
    assert len(seen) == 7


def test_the_server_s_entries_are_queued_when_idle_as_memory_still_holds_them(
    load_tiny, tmp_path
):
    """With ``spill_at_once`` off (the server's), an insert queues nothing
    (its state is made on the serving thread); ``spill_idle`` queues what
    memory holds as stored, never the cache a request fetched and wrote to
    since; an entry memory evicts waits for it too, within the queue's
    bytes (past them it is dropped and counted, as a put would drop it),
    or is queued by a request it may serve."""
    model, _ = load_tiny("llama")
    first, second = [1] + PROMPT[:200], [2] + PROMPT[:200]
    lru = disk_lru(tmp_path)
    lru.spill_at_once = False
    for tokens in (first, second):
        lru.insert_cache(MODEL, tokens, prefilled(model, tokens))
    assert lru.disk.queued == 0 and len(lru.disk) == 0
    taken, rest = lru.fetch_nearest_cache(MODEL, second + EXTRA)
    model(mx.array(rest)[None], cache=taken)  # the request writes to it
    lru.spill_idle()
    lru.disk.close()
    tier = disk(tmp_path)
    restored, rest = tier.get(MODEL, first + EXTRA)
    assert rest == EXTRA and same(live(restored), live(prefilled(model, first)))
    restored, rest = tier.get(MODEL, second + EXTRA)
    assert restored is None or same(live(restored), live(prefilled(model, second)))

    evicting = disk_lru(tmp_path / "evicting", max_size=1)
    evicting.spill_at_once = False
    for tokens in (first, second):
        evicting.insert_cache(MODEL, tokens, prefilled(model, tokens))
    assert evicting.disk.queued == 0 and evicting.disk.dropped == 0
    # A request it cannot serve better than memory leaves it; one it serves
    # queues it (get reads the queue)
    evicting.fetch_nearest_cache(MODEL, second + EXTRA)
    assert evicting.disk.queued == 0 and len(files(tmp_path / "evicting")) == 0
    restored, rest = evicting.fetch_nearest_cache(MODEL, first + EXTRA)
    assert rest == EXTRA and same(live(restored), live(prefilled(model, first)))
    evicting.spill_idle()  # the second: memory holds it
    evicting.disk.close()
    assert len(files(tmp_path / "evicting")) == 2

    small = disk_lru(tmp_path / "small", max_size=1, queue_bytes=1)
    small.spill_at_once = False
    for tokens in (first, second, [3] + PROMPT[:200]):
        small.insert_cache(MODEL, tokens, prefilled(model, tokens))
    # The first waits (nothing else does: any size), the second is dropped
    assert small.disk.queued == 0 and small.disk.dropped == 1
    small.spill_idle()
    small.disk.close()
    restored, rest = disk(tmp_path / "small").get(MODEL, first + EXTRA)
    assert rest == EXTRA and same(live(restored), live(prefilled(model, first)))


def test_a_prefix_a_longer_entry_replaced_is_freed_before_the_server_idles(
    load_tiny, tmp_path
):
    """Entries wait in memory for ``spill_idle``, but not the prefixes memory
    drops for a longer trimmable entry: a busy server would hold them past
    its budget. The longer one is written, and serves the prefix."""
    import gc
    import weakref

    model, _ = load_tiny("llama")
    first, longer = PROMPT[:200], PROMPT[:300]
    lru = disk_lru(tmp_path)
    lru.spill_at_once = False
    lru.insert_cache(MODEL, first, prefilled(model, first))
    dropped = weakref.ref(lru._trie.get(MODEL, first))
    lru.insert_cache(MODEL, longer, prefilled(model, longer))
    gc.collect()
    assert dropped() is None and len(lru) == 1
    lru.spill_idle()
    lru.disk.close()
    restored, rest = disk(tmp_path).get(MODEL, first + EXTRA)
    assert rest == EXTRA and same(live(restored), live(prefilled(model, first)))
