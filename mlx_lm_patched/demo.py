"""``make demo``: mlx-lm patched next to upstream, on a model trained here.

Runs ``python -m mlx_lm_patched.generate`` on the demo model (a small llama
trained on the standard library, ``tiny_train``: a sliding-window layer, so a
``RotatingKVCache``, and a full one, a ``KVCache``), then the same greedy
generation in-process with the patches reverted and applied, and prints peak
memory, cache bytes, cache buffer reallocations and whether the tokens match.
"""

import argparse
import re
import subprocess
import sys

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as cache_module
from mlx_lm.utils import load

import mlx_lm_patched
from mlx_lm_patched import tiny, tiny_train


def printable(text: str) -> str:
    """Keep control characters (a random model's bytes) off the terminal."""
    return re.sub(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", " ", text)


def prompt_text(tokenizer, n):
    """About ``n`` tokens of a held-out standard library module, cut so that
    the model is asked to write the next function: it ends in ``def ``."""
    text = tiny_train.corpus(held_out=True)[2]  # argparse.py
    ids = tokenizer.encode(text)[: n + 200]
    text = tokenizer.decode(ids)
    cut = text.rfind("\n    def ", 0, len(tokenizer.decode(ids[:n])) + 1)
    return text[: cut + 9] if cut > 0 else text


def buffers(keys):
    """Address and shape of each array behind a cache's ``keys``."""
    arrays = keys if isinstance(keys, (tuple, list)) else [keys]
    return [
        (np.frombuffer(memoryview(a), np.uint8).ctypes.data, a.shape) for a in arrays
    ]


def run(model, prompt, args, max_kv_size):
    """Greedy tokens, peak memory of prefill and of decode, final cache bytes,
    and how often a layer's ``keys`` moved to another buffer or changed shape
    between two prompt chunks or two decode steps (first allocation not
    counted). Only addresses are kept, so no buffer outlives its use."""
    cache = cache_module.make_prompt_cache(model, max_kv_size)
    last = [None] * len(cache)
    moves = {"prompt": 0, "decode": 0}

    def observe(phase):
        for i, c in enumerate(cache):
            keys = getattr(c, "keys", None)
            now = None if keys is None else buffers(keys)
            moves[phase] += last[i] is not None and now != last[i]
            last[i] = now

    mx.clear_cache()
    mx.reset_peak_memory()
    step = args.prefill_step_size
    for start in range(0, prompt.size - 1, step):
        model(prompt[None, start : min(start + step, prompt.size - 1)], cache=cache)
        mx.eval([c.state for c in cache])
        observe("prompt")
    tokens, peaks = [], [mx.get_peak_memory()]
    mx.reset_peak_memory()
    for token, _ in generate_step(
        prompt[-1:], model, max_tokens=args.max_tokens, prompt_cache=cache
    ):
        tokens.append(token)
        observe("decode")
    peaks.append(mx.get_peak_memory())
    kinds = sorted({type(c).__name__ for c in cache})
    nbytes = sum(c.nbytes for c in cache)
    return {
        "tokens": tokens,
        "peaks": peaks,
        "nbytes": nbytes,
        "moves": moves,
        "kinds": kinds,
    }


def side_by_side(model, prompt, args, max_kv_size):
    """Upstream (patches reverted) and patched runs of ``run``."""
    before = [n for n, s in mlx_lm_patched.status().items() if s["applied"]]
    try:
        mlx_lm_patched.revert()
        upstream = run(model, prompt, args, max_kv_size)
        mlx_lm_patched.apply()
        patched = run(model, prompt, args, max_kv_size)
    finally:
        mlx_lm_patched.revert()
        if before:
            mlx_lm_patched.apply(*before)
    return upstream, patched


def agreement(a, b):
    """``"identical"``, or where the two token lists part."""
    if a == b:
        return f"identical, {len(a)} of {len(a)}"
    first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return f"part at token {first + 1} of {len(a)}"


def kb(n):
    return f"{n / 1024:,.0f} KiB"


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m mlx_lm_patched.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", help="model directory (default: the demo model)")
    parser.add_argument("--prompt-tokens", type=int, default=600)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--max-kv-size", type=int, default=128)
    parser.add_argument("--prefill-step-size", type=int, default=64)
    args = parser.parse_args(argv)

    path = str(args.model or tiny.demo_model_dir())
    model, tokenizer = load(path)
    text = prompt_text(tokenizer, args.prompt_tokens)
    prompt = mx.array(tokenizer.encode(text))
    own = side_by_side(model, prompt, args, None)
    bounded = side_by_side(model, prompt, args, args.max_kv_size)

    n = args.max_tokens
    same = own[0]["tokens"] == own[1]["tokens"]
    print(
        f"mlx-lm-patched: the same {n} greedy tokens as mlx-lm "
        if same
        else f"mlx-lm-patched: tokens DIFFER from mlx-lm's "
    )
    print(
        f"  (model's own caches), decode reallocations {own[0]['moves']['decode']} "
        f"-> {own[1]['moves']['decode']}; with --max-kv-size {args.max_kv_size} the "
        f"cache ends at {kb(bounded[1]['nbytes'])}, upstream's at "
        f"{kb(bounded[0]['nbytes'])}."
    )
    print(
        f"\nModel: {path}, {len(model.layers)} layers, caches {', '.join(own[0]['kinds'])}"
    )
    print(
        f"  (trained here on Python's standard library; prompt: {prompt.size} "
        "tokens of argparse.py, held out of training)"
    )
    flags = ["--max-tokens", str(n), "--prefill-step-size", str(args.prefill_step_size)]
    cmd = [sys.executable, "-m", "mlx_lm_patched.generate", "--model", path]
    cmd += ["--ignore-chat-template", "--prompt", text] + flags
    print(
        f"\n$ python -m mlx_lm_patched.generate --model ... --prompt <the prompt> {' '.join(flags)}"
    )
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        sys.exit(f"mlx_lm_patched.generate failed with exit status {done.returncode}")
    generated = done.stdout.split("==========\n")[1].rstrip("\n").splitlines()
    print(printable("    def " + "\n".join(generated[:8])))
    print("    ..." if len(generated) > 8 else "", end="")
    print(
        "\n".join(
            printable(l) for l in done.stdout.split("==========\n")[2].splitlines()[:2]
        )
    )

    print(
        f"\nIn-process, greedy, {n} tokens, prompt in chunks of {args.prefill_step_size}:"
    )
    head = f"{'model caches':>22}{f'--max-kv-size {args.max_kv_size}':>24}"
    print(f"{'':<24}{head}")
    print(f"{'':<24}{'upstream':>11}{'patched':>11}{'upstream':>13}{'patched':>11}")
    rows = [
        ("peak memory, prompt", lambda r: kb(r["peaks"][0])),
        ("peak memory, decode", lambda r: kb(r["peaks"][1])),
        ("cache bytes at the end", lambda r: kb(r["nbytes"])),
        ("reallocations, prompt", lambda r: r["moves"]["prompt"]),
        ("reallocations, decode", lambda r: r["moves"]["decode"]),
    ]
    for label, cell in rows:
        a, b, c, d = (cell(r) for r in own + bounded)
        print(f"{label:<24}{a:>11}{b:>11}{c:>13}{d:>11}")
    print(f"{'tokens':<24}{agreement(*[r['tokens'] for r in own]):>22}", end="")
    print(f"{agreement(*[r['tokens'] for r in bounded]):>24}")
    print(
        "\nModel caches: the tokens must be identical, and are: the patched ring gives\n"
        "attention the same keys, values and masks upstream does, from a buffer\n"
        "allocated once. Prompt reallocations: a chunk that runs past a full ring is\n"
        "attended over the ring plus the chunk and leaves a new ring (upstream\n"
        "concatenates as well); from the first decode step on, nothing moves."
    )
    print(
        f"--max-kv-size {args.max_kv_size}: upstream ignores it for models that make "
        f"their own cache\n(its KVCache grows with the context: {', '.join(bounded[0]['kinds'])}); "
        f"patched, the full layer\nbecomes RotatingKVCache({args.max_kv_size}, keep=4) and "
        "forgets the middle of the context, so\nits tokens may differ. Upstream's own "
        "ring would differ too: it hides its 4 keep\ntokens from chunked queries (an "
        "upstream bug, fixed here; see README)."
    )
    if not same:
        sys.exit("the patches changed the tokens of the model's own caches")


if __name__ == "__main__":
    main()
