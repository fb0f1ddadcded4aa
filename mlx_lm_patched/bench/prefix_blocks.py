"""Shared prefixes in one prompt cache: bytes held, and what a fetch costs.

A tiny llama (``--dtype``) prefills ``--conversations`` conversations, each a
``--prefix``-token system prefix they share plus ``--tail`` tokens of their
own, each into a fresh ``make_prompt_cache``, and inserts each into one
``LRUPromptCache``. Reported per side (upstream: ``mlx_lm_patched.revert()``;
whole: patched, blocks larger than any prompt, so no entry shares one, as on
main before ``prompt_cache_blocks``; blocks_N: patched, blocks of N tokens):

  stored_bytes  the prompt cache's ``nbytes`` after the inserts
  held_bytes    active memory the entries hold once the working caches are gone
  ratio         stored_bytes / once_bytes (once_bytes: the prefix once plus
                every tail, from the model's geometry; issue #28's target 1.3)

On disk (``disk``), the same conversations go through a
``DiskLRUPromptCache`` (write-behind, then flushed), whole and in block
files of the default size (``block_tokens`` that size, not the tier's
1024): ``dir_bytes`` and its ``ratio`` to once_bytes, the
bytes of the block files every entry names (``shared_bytes``) and each
entry's own (its file and the blocks only it names, the mean), and from
them the ratio ``--many`` conversations would give (``ratio_at_many``).

Then, on the default block size, the two ways a fetch can give a working
cache of its own (``--repeats`` times each, the median): ``copy_at_fetch``
(what ``LRUPromptCache.fetch_nearest_cache`` does: blocks and tail
concatenated and evaluated at the fetch) and ``no_copy`` (the working
cache's arrays are the unevaluated concatenation: nothing is copied until
its first update). Each fetches a conversation plus ``--turn`` new tokens
and prefills them: fetch_s, prefill_s, and peak (MLX's peak above the
memory held before the fetch); and ``max_abs_logit_diff`` between that
prefill's logits and those of a fresh cache fed the same chunks
(the conversation, then the turn).
"""

import argparse
import copy
import os
import statistics
import tempfile
import time

import mlx.core as mx

import mlx_lm_patched

from . import emit, header, parse_args


def conversations(n, prefix, tail, vocab):
    system = [(7 * j + 3) % vocab for j in range(prefix)]
    return [
        system + [(11 * j + 5 * i + 1) % vocab for j in range(tail)] for i in range(n)
    ]


def prefill(model, tokens, cache):
    logits = model(mx.array(tokens)[None], cache=cache)
    mx.eval(logits, [c.state for c in cache])
    return logits


def fill(caches, convs, block_size):
    """An ``LRUPromptCache`` holding ``caches``, the caches of ``convs``, and
    the active memory it holds."""
    from mlx_lm.models import cache as cache_module

    mx.clear_cache()
    before = mx.get_active_memory()
    lru = cache_module.LRUPromptCache(max_size=len(convs))
    if block_size is not None:
        lru._blocks = cache_module.PromptBlocks(block_size)
    for tokens, cache in zip(convs, caches):  # upstream keeps what it is given
        lru.insert_cache("model", tokens, copy.deepcopy(cache))
    if block_size is not None:  # at rest, as a server's next request makes them
        lru._settle()
    mx.synchronize()  # the copies the inserts scheduled are made
    mx.clear_cache()
    return lru, mx.get_active_memory() - before


def on_disk(caches, convs, block_size, args, per_token):
    """What a ``DiskLRUPromptCache``'s directory holds for ``convs`` (see
    the module)."""
    from mlx_lm.models import cache as cache_module
    from mlx_lm.models.prompt_cache_disk import DiskLRUPromptCache, DiskPromptCache

    with tempfile.TemporaryDirectory(prefix="mlx-lm-patched-prefix-") as d:
        tier = DiskPromptCache(d, block_tokens=block_size)
        lru = DiskLRUPromptCache(tier, max_size=len(convs))
        lru._blocks = cache_module.PromptBlocks(block_size)
        for tokens, cache in zip(convs, caches):
            lru.insert_cache("model", tokens, cache)
        tier.flush()
        size = {e.name: e.stat().st_size for e in os.scandir(d)}
        refs = {name: tier._refs(name) for name in tier._files}
        tier.close()
    shared = set.intersection(*refs.values())
    own = [size[n] + sum(size[b] for b in r - shared) for n, r in refs.items()]
    shared_bytes, own_each = sum(size[b] for b in shared), statistics.mean(own)

    def once(n):  # the prefix once and n tails
        return per_token * (args.prefix + n * args.tail)

    return {
        "dir_bytes": sum(size.values()),
        "ratio": round(sum(size.values()) / once(len(convs)), 3),
        "shared_bytes": shared_bytes,
        "own_bytes_each": round(own_each),
        "ratio_at_many": round(
            (shared_bytes + args.many * own_each) / once(args.many), 3
        ),
    }


def fetch(model, lru, tokens, turn, lazy):
    mx.clear_cache()
    start = mx.get_active_memory()
    mx.reset_peak_memory()
    tic = time.perf_counter()
    if lazy:  # the entry's layers, concatenated but not evaluated
        entry = lru._trie.get("model", tokens)
        cache, rest = lru._blocks.assemble(entry.prompt_cache), turn
    else:
        cache, rest = lru.fetch_nearest_cache("model", tokens + turn)
    fetched = time.perf_counter()
    logits = prefill(model, rest, cache)
    done = time.perf_counter()
    return logits, fetched - tic, done - fetched, mx.get_peak_memory() - start


def build_parser():
    p = argparse.ArgumentParser(prog="python -m mlx_lm_patched.bench prefix_blocks")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--prefix", type=int, default=2000)
    p.add_argument("--tail", type=int, default=200)
    p.add_argument("--turn", type=int, default=50, help="new tokens after a fetch")
    p.add_argument("--block-sizes", type=int, nargs="+", default=[16, 64, 256])
    p.add_argument("--many", type=int, default=1000, help="conversations, on disk")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", choices=["cpu", "gpu"])
    p.add_argument("--out", help="also write the JSON to this file")
    return p


def main(argv=None):
    from mlx_lm.models.cache import PromptBlocks, make_prompt_cache

    from mlx_lm_patched.demo import tiny

    args = parse_args(build_parser(), argv)
    mx.set_cache_limit(0)  # active memory counts what is held, not reused blocks
    model, _ = tiny.tiny_model("llama", dtype=args.dtype)
    config = tiny.model_config("llama")
    per_token = (
        2
        * config["num_hidden_layers"]
        * config["num_key_value_heads"]
        * config["head_dim"]
        * getattr(mx, args.dtype).size
    )
    convs = conversations(args.conversations, args.prefix, args.tail, tiny.VOCAB_SIZE)
    once = per_token * (args.prefix + args.conversations * args.tail)
    result = {
        **header("prefix_blocks", [p.name for p in mlx_lm_patched.PATCHES]),
        "conversations": args.conversations,
        "prefix": args.prefix,
        "tail": args.tail,
        "dtype": args.dtype,
        "default_block_size": PromptBlocks().block_size,
        "once_bytes": once,
    }
    caches = []  # prefilled once, for every side
    for tokens in convs:
        caches.append(make_prompt_cache(model))
        prefill(model, tokens, caches[-1])
    sides = [("whole", 1 << 40)] + [(f"blocks_{n}", n) for n in args.block_sizes]
    for name, block_size in sides + [("upstream", None)]:
        (mlx_lm_patched.revert if name == "upstream" else mlx_lm_patched.apply)()
        lru, held = fill(caches, convs, block_size)
        result[name] = {
            "stored_bytes": lru.nbytes,
            "ratio": round(lru.nbytes / once, 3),
        }
        if name != "upstream":  # upstream keeps the very caches it is given
            result[name]["held_bytes"] = held
        del lru
    mlx_lm_patched.apply()
    default = PromptBlocks().block_size
    result["disk"] = {
        name: on_disk(caches, convs, size, args, per_token)
        for name, size in (("whole", 1 << 40), (f"blocks_{default}", default))
    }
    result["disk"]["many"] = args.many

    lru, _ = fill(caches, convs, default)
    del caches
    turn = [(13 * j + 2) % tiny.VOCAB_SIZE for j in range(args.turn)]
    reference = make_prompt_cache(model)
    prefill(model, convs[-1], reference)
    want = prefill(model, turn, reference)
    for name, lazy in (("copy_at_fetch", False), ("no_copy", True)):
        runs = [fetch(model, lru, convs[-1], turn, lazy) for _ in range(args.repeats)]
        logits = runs[-1][0]
        result[name] = {
            "fetch_s": statistics.median(r[1] for r in runs),
            "prefill_s": statistics.median(r[2] for r in runs),
            "peak": max(r[3] for r in runs),
            "max_abs_logit_diff": mx.abs(logits - want).max().item(),
        }
    result["targets"] = {
        "ratio_at_most_1.3": (
            result[f"blocks_{result['default_block_size']}"]["ratio"] <= 1.3
            if f"blocks_{result['default_block_size']}" in result
            else None
        ),
        "same_logits": result["copy_at_fetch"]["max_abs_logit_diff"] == 0,
        "disk_ratio_at_most_1.3": result["disk"][f"blocks_{default}"]["ratio"] <= 1.3,
    }
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
