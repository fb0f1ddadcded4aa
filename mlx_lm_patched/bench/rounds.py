"""Rounds of concurrent requests through the server: what prefix reuse buys.

A server (``python -m mlx_lm_patched.server``, a subprocess on 127.0.0.1)
per side: ``bf16`` and ``kv4`` (``--kv-bits 4 --quantized-kv-start 0``) by
default. Each round sends the same ``--requests`` completions at once
(distinct prompts of ``--words`` words; with ``--re-render``, rounds after
the first change each prompt's last word, as a chat client re-renders an
end) and times the round until every reply is in; the replies' cached
tokens say what the prompt cache served. ``--first-alone`` sends the first
round one request at a time: prompts prefilled together (right padded)
keep no evicted tokens, bfloat16 or quantized, so what they store can be
reused exactly only. The default model is a tiny
gemma3_text (sliding window 64, random weights): its rings wrap, so a hit
that is not exact needs the ring's slack.

    python -m mlx_lm_patched.bench rounds [--rounds 3] [--re-render]
        [--first-alone] [--flags "--prompt-cache-size 64"] [--out f]
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import mlx_lm_patched
from mlx_lm_patched.demo import tiny

from . import emit, header

SIDES = {"bf16": [], "kv4": ["--kv-bits", "4", "--quantized-kv-start", "0"]}


def prompts(n, words):
    """``n`` distinct prompts of ``words`` words of ``tiny.TEXT``."""
    text = tiny.TEXT.split()
    return [" ".join((text * 4)[7 * i : 7 * i + words]) for i in range(n)]


def post(port, body, timeout):
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


def serve(model, flags, log):
    """A server subprocess on a free port, healthy; ``(process, port)``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "mlx_lm_patched.server", "--model", model]
    cmd += ["--host", "127.0.0.1", "--port", str(port), *flags]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    for _ in range(600):  # 120 s
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {' '.join(cmd)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                return proc, port
        except OSError:
            time.sleep(0.2)
    stop(proc)
    raise TimeoutError("server not healthy after 120 s")


def stop(proc):
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def one_round(port, texts, max_tokens, timeout, alone=False):
    """Every completion at once (``alone``: one after the other): wall
    seconds and each reply's usage."""
    usages = [None] * len(texts)

    def ask(i):
        body = {"prompt": texts[i], "max_tokens": max_tokens, "temperature": 0}
        usages[i] = post(port, body, timeout)["usage"]

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(texts))]
    tic = time.perf_counter()
    for t in threads:
        t.start()
        if alone:
            t.join()
    for t in threads:
        t.join()
    seconds = time.perf_counter() - tic
    if None in usages:
        raise RuntimeError("a request failed (see the server log)")
    return seconds, usages


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="an mlx-lm model directory (default: tiny gemma3)")
    p.add_argument("--sides", default="bf16,kv4", help=f"of {', '.join(SIDES)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--words", type=int, default=300, help="words a prompt")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--re-render", action="store_true")
    p.add_argument(
        "--first-alone",
        action="store_true",
        help="send the first round's requests one at a time",
    )
    p.add_argument("--flags", default="", help="more server flags")
    p.add_argument("--timeout", type=float, default=300, help="seconds a request")
    p.add_argument("--out")
    args = p.parse_args(argv)
    result = header("rounds", [p.name for p in mlx_lm_patched.PATCHES])
    result["config"] = {k: v for k, v in vars(args).items() if k != "out"}
    texts = prompts(args.requests, args.words)
    with tempfile.TemporaryDirectory() as d:
        model = args.model or str(
            tiny.make_model_dir(os.path.join(d, "m"), "gemma3_text")
        )
        for side in args.sides.split(","):
            with open(os.path.join(d, f"{side}.log"), "w") as log:
                proc, port = serve(model, SIDES[side] + args.flags.split(), log)
                try:
                    rounds = []
                    for r in range(args.rounds):
                        sent = texts
                        if args.re_render and r:
                            sent = [f"{t.rsplit(' ', 1)[0]} round{r}" for t in texts]
                        alone = args.first_alone and not r
                        seconds, usages = one_round(
                            port, sent, args.max_tokens, args.timeout, alone
                        )
                        cached = [
                            u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                            for u in usages
                        ]
                        rounds.append(
                            {
                                "seconds": round(seconds, 3),
                                "prompt_tokens": sum(
                                    u["prompt_tokens"] for u in usages
                                ),
                                "cached_tokens": sum(cached),
                                "hits": sum(c > 0 for c in cached),
                            }
                        )
                finally:
                    stop(proc)
            result[side] = rounds
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
