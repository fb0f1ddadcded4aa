"""``make demo``: mlx-lm patched next to upstream, on a model trained here.

Runs ``python -m mlx_lm_patched.generate`` on the demo model (a small llama
trained on the standard library, ``tiny_train``: a sliding-window layer, so a
``RotatingKVCache``, and a full one, a ``KVCache``), then the same greedy
generation in-process with the patches reverted and applied, and prints cache
bytes, cache buffer reallocations and whether the tokens match: counts that do
not move from run to run (peak memory does, by more than the difference at
this model's size), then the next command to try.
Both in-process sides decode greedily with mlx-lm's repetition penalty (1.2 by
default, ``--repetition-penalty 1`` for none): plain greedy decoding repeats
itself within a few lines on a model this small.
"""

import argparse
import re
import shlex
import subprocess
import sys
import warnings
from collections import Counter

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.models import cache as cache_module
from mlx_lm.sample_utils import make_logits_processors
from mlx_lm.utils import load

import mlx_lm_patched
from mlx_lm_patched.bench.memory import pointer
from mlx_lm_patched.demo import tiny_train


def printable(text: str) -> str:
    """Keep control characters (a random model's bytes) off the terminal."""
    return re.sub(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]", " ", text)


def prompt_text(tokenizer, n):
    """About ``n`` tokens of a held-out standard library module (contextlib),
    from its first class on, cut so that the model is asked to write the
    next method: the prompt ends in ``def`` (its space starts the next
    token, as in the text the model learnt from)."""
    text = next(
        f.read_text()
        for f in tiny_train.corpus_files(held_out=True)
        if f.name == "contextlib.py"
    )
    text = text[text.find("\nclass ") + 1 :]
    head = tokenizer.decode(tokenizer.encode(text[: 8 * n])[:n])
    cut = head.rfind("\n    def ")
    return head[: cut + len("\n    def")] if cut > 0 else head


def buffers(keys):
    """Shape and address of each array behind a cache's ``keys``."""
    arrays = keys if isinstance(keys, (tuple, list)) else [keys]
    return [(a.shape, pointer(a)) for a in arrays]


def run(model, prompt, args, max_kv_size):
    """Greedy tokens, cache bytes after the prompt and at the end, and
    reallocations counted as ``bench memory`` counts them: a layer's
    ``keys`` changing shape after a prompt chunk, or changing shape or buffer
    after a decode step (first allocation not counted). A chunk past a full
    ring leaves a new ring of the same shape, upstream's as the patched
    one's: not counted, and the output says so. Only addresses are kept, so
    no buffer outlives its use."""
    cache = cache_module.make_prompt_cache(model, max_kv_size)
    last = [None] * len(cache)
    moves = Counter()

    def observe(phase):
        for i, c in enumerate(cache):
            keys = getattr(c, "keys", None)
            now = None if keys is None else buffers(keys)
            if last[i] is not None and now != last[i]:
                shapes = [shape for shape, _ in now or []]
                moved = phase == "decode" or shapes != [s for s, _ in last[i]]
                moves[phase, type(c).__name__] += moved
            last[i] = now

    step = args.prefill_step_size
    for start in range(0, prompt.size - 1, step):
        model(prompt[None, start : min(start + step, prompt.size - 1)], cache=cache)
        mx.eval([c.state for c in cache])
        observe("prompt")
    tokens, nbytes = [], [sum(c.nbytes for c in cache)]
    penalty = args.repetition_penalty
    processors = make_logits_processors(repetition_penalty=penalty)
    for token, _ in generate_step(
        prompt[-1:],
        model,
        max_tokens=args.max_tokens,
        prompt_cache=cache,
        logits_processors=processors,
    ):
        tokens.append(token)
        observe("decode")
    nbytes.append(sum(c.nbytes for c in cache))
    kinds = sorted({type(c).__name__ for c in cache})
    return {
        "tokens": tokens,
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
        return f"identical ({len(a)} of {len(a)})"
    first = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return f"part at token {first + 1}"


def kb(n):
    return f"{n / 1024:,.0f} KiB"


def cli_run(path, text, args):
    """``python -m mlx_lm_patched.generate`` on the prompt: its statistics."""
    flags = ["--max-tokens", str(args.max_tokens)]
    flags += ["--prefill-step-size", str(args.prefill_step_size)]
    print(
        "$ python -m mlx_lm_patched.generate --model <the model> "
        f"--ignore-chat-template --prompt <the prompt> {' '.join(flags)}"
    )
    cmd = [sys.executable, "-m", "mlx_lm_patched.generate", "--model", path]
    cmd += ["--ignore-chat-template", "--prompt", text] + flags
    done = subprocess.run(cmd, capture_output=True, text=True, errors="replace")
    if done.returncode:
        print(done.stderr, file=sys.stderr)
        sys.exit(f"mlx_lm_patched.generate failed with exit status {done.returncode}")
    stats = done.stdout.split("==========\n")[-1]
    print("  " + "; ".join(stats.strip().splitlines()[:3]))


def show(text, answer, shown=16):
    """The prompt's last two lines and the ``answer``, ``shown`` lines at most."""
    tail = text.splitlines()[-2:]
    lines = (tail[0] + "\n" + tail[1] + printable(answer).rstrip()).splitlines()
    for line in lines[:shown]:
        print(f"  | {line}")
    if len(lines) > shown:
        print(f"  | ... ({len(lines) - shown} more lines)")


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m mlx_lm_patched.demo", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--model", help="model directory (default: the demo model)")
    # The demo model was trained on 256-token windows: prompt and answer fit.
    parser.add_argument("--prompt-tokens", type=int, default=160)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--max-kv-size", type=int, default=128)
    parser.add_argument("--prefill-step-size", type=int, default=32)
    # Plain greedy repeats itself within a few lines on a model this small.
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.2,
        help="mlx-lm's repetition penalty, upstream and patched alike (1: none)",
    )
    args = parser.parse_args(argv)

    path = str(args.model or tiny_train.demo_model_dir())
    model, tokenizer = load(path)
    text = prompt_text(tokenizer, args.prompt_tokens)
    prompt = mx.array(tokenizer.encode(text))
    warnings.filterwarnings("ignore", "mlx_lm_patched: max_kv_size")  # said below
    own = side_by_side(model, prompt, args, None)
    bounded = side_by_side(model, prompt, args, args.max_kv_size)
    ring = "RotatingKVCache"
    n, size = args.max_tokens, args.max_kv_size
    same = own[0]["tokens"] == own[1]["tokens"]

    penalty = args.repetition_penalty
    how = "greedy" + (f", repetition penalty {penalty}" if penalty != 1 else "")
    print(f"mlx-lm-patched demo: {how}; patched next to upstream mlx-lm")
    print(
        f"- the model's own caches: {'the same' if same else 'DIFFERENT'} {n} tokens; "
        f"the ring reallocated {own[1]['moves']['decode', ring]} times while "
        f"decoding (upstream: {own[0]['moves']['decode', ring]})"
    )
    print(
        f"- --max-kv-size {size}: the cache ends at {kb(bounded[1]['nbytes'][1])}; "
        "upstream ignores the flag for this model "
        f"({kb(bounded[0]['nbytes'][1])}, a KVCache that grows 256 tokens at a time)"
    )
    own_caches = cache_module.make_prompt_cache(model)
    layers = ", ".join(
        f"{i}: {type(c).__name__}"
        + (f"({c.max_size})" if hasattr(c, "max_size") else "")
        for i, c in enumerate(own_caches)
    )
    print(f"\nModel: {path} ({len(model.layers)} layers; caches {layers})")
    print(
        f"Prompt: {prompt.size} tokens of contextlib.py, held out of the model's "
        "training, ending in 'def'\n"
    )
    cli_run(path, text, args)
    answer = tokenizer.decode(prompt.tolist() + own[1]["tokens"])
    print(f"\nThe text of the runs below ({how}, upstream and patched alike):")
    if penalty != 1:
        print("(the command line has no penalty: plain greedy repeats itself sooner)")
    show(text, answer[len(tokenizer.decode(prompt.tolist())) :])

    print(f"\nIn-process, {how} (prompt in chunks of {args.prefill_step_size}):")
    print(f"{'':<38}{'model caches':>20}{f'--max-kv-size {size}':>22}")
    print(f"{'':<38}{'upstream':>10}{'patched':>10}{'upstream':>12}{'patched':>10}")
    rows = [
        ("cache bytes after the prompt", lambda r: kb(r["nbytes"][0])),
        ("cache bytes at the end", lambda r: kb(r["nbytes"][1])),
    ]
    keys = sorted(set().union(*(r["moves"] for r in own + bounded)))
    for phase, kind in sorted(keys, key=lambda k: (k[0] == "decode", k[1])):
        label = f"reallocations, {phase}, {kind}"
        rows.append((label, lambda r, k=(phase, kind): r["moves"][k]))
    for label, cell in rows:
        a, b, c, d = (cell(r) for r in own + bounded)
        print(f"{label:<38}{a:>10}{b:>10}{c:>12}{d:>10}")
    window = min(getattr(c, "max_size", prompt.size) for c in own_caches)
    step = args.prefill_step_size
    ends = range(step, prompt.size - 1 + step, step)
    past = sum(min(end, prompt.size - 1) > window for end in ends)
    print(f"{'tokens':<38}{agreement(*[r['tokens'] for r in own]):>20}", end="")
    print(f"{agreement(*[r['tokens'] for r in bounded]):>22}")
    print(
        "\nModel caches: the tokens must be identical, and are: the patched ring gives\n"
        "attention the keys, values and masks upstream's does, from a buffer written\n"
        "in place by every decode step and by the chunks that fill it (upstream's\n"
        "ring grows by concatenating). A reallocation is a layer's keys changing\n"
        "shape after a prompt chunk, or shape or buffer after a decode step (as\n"
        f"bench memory counts them). Not counted: {past} of the prompt's chunks ran past\n"
        f"the full {window}-token ring, and each left a new ring of the same shape,\n"
        "patched as upstream (writing into the old one would need a sync inside the\n"
        "model).\n"
        f"--max-kv-size {size}: upstream ignores it for models that make their own\n"
        f"cache, so its KVCache grows; patched, layer 1 becomes RotatingKVCache({size},\n"
        "keep=4), which forgets the middle of the context, so its tokens may differ.\n"
        "Upstream's own ring would part from the patched one too: it hides its 4 keep\n"
        "tokens from chunked queries, an upstream bug fixed here (docs/reference.md).\n"
        "Peak memory is left out: at this model's size it moves from run to run by\n"
        "more than the difference (bench memory and bench e2e measure it at scale)."
    )
    model_arg = shlex.quote(path)
    print(
        "\nNext, on this model or any mlx-lm model directory:\n"
        f"  python -m mlx_lm_patched.generate --model {model_arg} --ignore-chat-template "
        f'--prompt "def fib(n):" --max-kv-size 64 --kv-bits 8 --quantized-kv-start 0\n'
        "  python -m mlx_lm_patched.bench quality   "
        "# what rings and --kv-bits cost: agreement, bytes"
    )
    if not same:
        sys.exit("the patches changed the tokens of the model's own caches")


if __name__ == "__main__":
    main()
