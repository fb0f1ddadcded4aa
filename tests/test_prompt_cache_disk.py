"""Disk tier: ``DiskPromptCache`` writes prompt caches on a background
thread and finds them again after a restart, bit for bit (bfloat16,
quantized, rings), bounded by its byte budget; corrupt, truncated and
foreign files are skipped with a warning naming them. ``DiskLRUPromptCache``
spills what memory evicts and reads it back where upstream's
``LRUPromptCache`` has nothing."""

import copy
import logging
import os

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


def prefilled(model, tokens, kv_bits=None):
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
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


def disk(directory, max_bytes=1 << 63):
    from mlx_lm.models.cache import DiskPromptCache

    return DiskPromptCache(str(directory), max_bytes)


def written(directory, *entries, max_bytes=1 << 63):
    """A closed tier in ``directory`` holding ``entries`` of (tokens, cache)."""
    tier = disk(directory, max_bytes)
    for tokens, cache in entries:
        tier.put(MODEL, tokens, cache)
        tier.flush()
    tier.close()
    return tier


def files(directory):
    return sorted(os.listdir(directory))


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


def test_put_copies_the_cache_before_it_returns(load_tiny, tmp_path):
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


def test_budget_drops_the_least_recently_used_files(load_tiny, tmp_path):
    model, _ = load_tiny("llama")
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

    assert len(files(tmp_path)) == 2 and tier.nbytes == 2 * one
    restarted = disk(tmp_path)
    assert restarted.get(MODEL, b + EXTRA) is None
    assert restarted.get(MODEL, a + EXTRA)[1] == EXTRA
    assert restarted.get(MODEL, c + EXTRA)[1] == EXTRA
    # A smaller budget after a restart drops files at once, oldest first.
    assert len(disk(tmp_path, max_bytes=one)) == 1 and len(files(tmp_path)) == 1


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
    from mlx_lm.models.cache import DiskPromptCache

    with pytest.raises(ValueError, match="max_bytes must be >= 0, got -1"):
        DiskPromptCache(str(tmp_path), -1)
    tier = disk(tmp_path)
    tier.close()
    model, _ = load_tiny("llama")
    with pytest.raises(ValueError, match="after close"):
        tier.put(MODEL, PROMPT[:10], prefilled(model, PROMPT[:10]))
    assert files(tmp_path) == []


def test_evicted_entries_are_read_back_where_upstream_has_none(load_tiny, tmp_path):
    from mlx_lm.models.cache import DiskLRUPromptCache, LRUPromptCache

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
