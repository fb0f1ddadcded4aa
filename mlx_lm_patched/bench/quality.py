"""What the bounded and quantized caches cost in quality, on held-out text.

Held-out standard library modules (never trained on by the demo model) are
cut into sequences and run teacher-forced, in prefill chunks, through each
cache: perplexity of the next token, and how often its greedy choice is the
one of the bfloat16 model with an unbounded cache. ``--model DIR`` runs the
same table on any mlx-lm model.
"""

import argparse
import math
import warnings

import mlx.core as mx
from mlx_lm.generate import _merge_caches, maybe_quantize_kv_cache
from mlx_lm.models.cache import LRUPromptCache, make_prompt_cache
from mlx_lm.utils import load
from tqdm import tqdm

from mlx_lm_patched.demo import tiny_train


def sequences(tokenizer, count, length):
    """``count`` sequences of ``length`` tokens from the held-out modules."""
    out = []
    for text in tiny_train.corpus(held_out=True):
        # Whole modules, cut below: no "sequence length is longer" warning.
        ids = tokenizer.encode(text, verbose=False)
        out += [ids[i : i + length] for i in range(0, len(ids) - length, length)]
        if len(out) >= count:
            return out[:count]
    return out


def run(model, tokens, chunk, max_kv_size=None, kv_bits=None, group=64, cache=None):
    """Logits of every position of ``tokens`` (teacher-forced, ``chunk`` at a
    time, quantized after each call as ``generate_step`` does), and the cache."""
    cache = cache or make_prompt_cache(model, max_kv_size)
    logits = []
    for start in range(0, len(tokens), chunk):
        logits.append(model(mx.array(tokens[start : start + chunk])[None], cache=cache))
        if kv_bits:
            maybe_quantize_kv_cache(cache, 0, group, kv_bits)
        mx.eval(logits[-1])
    return mx.concatenate(logits, axis=1)[0], cache


def at_rest_run(model, tokens, chunk, bits, max_kv_size=None):
    """A prompt cache entry quantized at rest: the first half prefilled and
    stored in ``LRUPromptCache(bits=bits)``, fetched back (dequantized) for
    the whole sequence, the rest run on it. Logits of every position, and
    the entry's bytes. With ``max_kv_size`` its layers are rings."""
    half = len(tokens) // 2
    first, cache = run(model, tokens[:half], chunk, max_kv_size)
    store = LRUPromptCache(bits=bits)
    store.insert_cache("m", tokens[:half], cache)
    store._settle()  # at rest, as a server's next request puts it
    fetched, rest = store.fetch_nearest_cache("m", tokens)
    second, _ = run(model, rest, chunk, cache=fetched)
    return mx.concatenate([first, second]), store.nbytes


def batch_run(model, seqs, chunk):
    """The server's road: each prompt prefilled alone (prefixes of different
    lengths), the caches merged into one batch (left-padded), then decoded
    together a token a step. Logits of every position each row reached."""
    length = len(seqs[0])
    prefixes = [length // 2 - 8 * (i % 8) for i in range(len(seqs))]
    rows, caches = [], []
    for seq, p in zip(seqs, prefixes):
        logits, cache = run(model, seq[:p], chunk)
        rows.append([logits])
        caches.append(cache)
    cache = _merge_caches(caches)
    for step in range(length - min(prefixes)):
        # A row at its end is fed its last token again; those logits are dropped.
        at = [min(p + step, length - 1) for p in prefixes]
        out = model(mx.array([[seq[i]] for seq, i in zip(seqs, at)]), cache=cache)
        mx.eval(out)
        for row, logits, p in zip(rows, out, prefixes):
            if p + step < length:
                row.append(logits)
    return [mx.concatenate(row, axis=0) for row in rows]


def score(logits, tokens, reference):
    """Summed negative log-likelihood of the next tokens, greedy agreements
    with ``reference``'s logits, and the number of positions."""
    n = logits.shape[0] - 1
    logprobs = logits[:n].astype(mx.float32)
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    targets = mx.array(tokens[1 : n + 1])
    nll = -mx.take_along_axis(logprobs, targets[:, None], axis=-1).sum()
    same = (logits[:n].argmax(-1) == reference[:n].argmax(-1)).sum()
    return nll.item(), same.item(), n


def rows(args):
    rings = [int(r) for r in args.rings.split(",")]
    yield "bf16, unbounded (the reference)", {}
    for r in rings:
        yield f"ring {r} (max_kv_size, keep 4)", {"max_kv_size": r}
    for bits in (8, 4):
        for group in (64, 32):
            yield f"kv-bits {bits}, group {group}", {"kv_bits": bits, "group": group}
    for bits in (8, 4):
        r = rings[len(rings) // 2]
        yield f"kv-bits {bits}, group 64, ring {r}", {"kv_bits": bits, "max_kv_size": r}
    for bits in (8, 4):
        yield f"prompt cache entry at rest, {bits}-bit (half)", {"at_rest": bits}
    for bits in (8, 4):
        r = rings[len(rings) // 2]
        options = {"at_rest": bits, "max_kv_size": r}
        yield f"entry at rest, {bits}-bit, ring {r} (half)", options


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m mlx_lm_patched.bench quality",
        description=__doc__.split("\n")[0],
    )
    parser.add_argument(
        "--model", help="an mlx-lm model directory (default: the demo model)"
    )
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--length", type=int, default=256, help="tokens a sequence")
    parser.add_argument("--chunk", type=int, default=64, help="prefill chunk")
    parser.add_argument("--rings", default="128,64,32", help="max_kv_size values")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore", "mlx_lm_patched: max_kv_size")  # the rows say
    path = str(args.model or tiny_train.demo_model_dir())
    model, tokenizer = load(path)
    model.set_dtype(mx.bfloat16)
    seqs = sequences(tokenizer, args.sequences, args.length)
    kinds = sorted({type(c).__name__ for c in make_prompt_cache(model)})
    print(
        f"model {path}: {len(model.layers)} layers, caches {', '.join(kinds)}; bfloat16"
    )
    print(
        f"{len(seqs)} held-out standard library sequences of {args.length} tokens, "
        f"prefilled {args.chunk} at a time, teacher-forced"
    )
    print(
        "agreement: the greedy next token equals bf16 unbounded's, position by position"
    )
    references = [run(model, s, args.chunk)[0] for s in seqs]
    table = []
    todo = list(rows(args)) + [
        (f"batch of {len(seqs)} (merged, left-padded) vs single", None)
    ]
    for label, options in tqdm(todo, desc="caches", unit="row", leave=False):
        nll = same = n = nbytes = 0
        if options is None:
            outs = batch_run(model, seqs, args.chunk)
            nbytes = None
        else:
            outs = []
            for s in seqs:
                if "at_rest" in options:
                    logits, held = at_rest_run(
                        model,
                        s,
                        args.chunk,
                        options["at_rest"],
                        options.get("max_kv_size"),
                    )
                else:
                    logits, cache = run(model, s, args.chunk, **options)
                    held = sum(c.nbytes for c in cache)
                outs.append(logits)
                nbytes += held / len(seqs)
        for logits, s, ref in zip(outs, seqs, references):
            a, b, c = score(logits, s, ref)
            nll, same, n = nll + a, same + b, n + c
        table.append((label, math.exp(nll / n), 100 * same / n, nbytes))
    print(f"\n{'cache':<44}{'perplexity':>11}{'agreement':>11}{'cache bytes':>13}")
    for label, ppl, agree, nbytes in table:
        size = "" if nbytes is None else f"{nbytes / 1024:.0f} KiB"
        print(f"{label:<44}{ppl:>11.3f}{agree:>10.1f}%{size:>13}")
    return table


if __name__ == "__main__":
    main()
