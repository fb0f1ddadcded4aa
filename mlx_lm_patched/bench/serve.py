"""The server as clients meet it: upstream's and ours over HTTP, TTFT.

Each side is a server subprocess on the same model (``--model DIR``, or
``--shape``: one written by ``tiny.make_model_dir`` with the tiny BPE
tokenizer; ``8b`` is Llama-3-8B's shape, ``gemma3-8b`` the same body as
``gemma3_text`` with 5 of 6 layers sliding over 1,024 tokens, both bf16
with random weights; ``tiny`` and ``tiny-gemma3`` run on a CPU in
seconds). A stdlib client sends streaming OpenAI-style requests
(``/v1/chat/completions`` where the tokenizer has a chat template,
``/v1/completions`` otherwise; ``stream_options.include_usage``,
temperature 0) and times the first content chunk (TTFT) and the whole
reply; ``cached_tokens`` is what the server reports in
``usage.prompt_tokens_details``. Scenarios:

  agent       a system prompt of ``--system`` tokens and a ``--tool``-token
              task; each turn appends the reply (``--reply`` tokens) and a
              ``--tool``-token tool result, ``--turns`` turns: turn 0's
              TTFT and the median of the others'
  repeated    the same ``--long``-token prompt twice
  shared      ``--shared-requests`` requests, one after another, sharing a
              ``--shared``-token system text, each with ``--own`` tokens of
              its own: the first's TTFT and the median of the others'
  edited      a ``--edited``-token conversation of ``--tool``-token
              messages, then the same with a word inserted ``--edit-chars``
              characters before its end: cached tokens against the prefix
              the two prompts share
  restart     a ``--long``-token prompt cold, SIGTERM, a restart, the
              prompt again (a disk hit); a second prompt, its files
              written, kill -9, a restart, that prompt again (sides with
              a prompt-cache directory only); each server answers a
              32-token prompt first, so no TTFT but that one's
              (``ttft_load_s``) waits for the model's load (upstream's
              ``/health`` answers before it; ours once loaded)
  concurrent  ``--concurrent`` agent loops of ``--concurrent-turns`` turns
              at once, sharing a ``--system``-token system prompt, after
              a 32-token prompt (``ttft_load_s``: the model's load): wall
              time, TTFT p50 and p95 over all turns, prompt-cache bytes
              (the last the server logged, ``--settle`` seconds idle after:
              the patched server logs what it holds at rest; the largest
              logged is ``prompt_cache_bytes_max``)

Sides: ``upstream`` (``python -m mlx_lm.server``), ``patched`` (``python -m
mlx_lm_patched.server``), with ``-dir`` (``--prompt-cache-dir``, a temporary
directory), ``-bits8`` / ``-bits4`` (``--prompt-cache-bits``), combinable
(``patched-dir-bits4``). Each scenario runs on fresh servers (``--reuse``:
one server per side and run for all scenarios, each scenario with texts of
its own), one side after another, the order reversed every other run;
``--runs`` R gives medians of R runs. With ``--warmup`` each side first
starts a server that answers one prompt and stops, so the first side's first
request does not pay the machine's kernel builds (MLX's PTX cache) for the
others. ``--scale`` multiplies the token counts not given. ``--breakdown``
runs every side at ``--log-level DEBUG`` (upstream's handler then logs each
token's text, which slowed an H200's decode steps from 10-14 to 19-20 ms:
every side alike, or the comparison is off) and reports, per scenario, the
median of each ``key=value`` of the patched sides' ``timing:`` log lines
(``timing_ms``), and of the hits' alone (``hits_timing_ms``: the turns after
the first, the prompt again, the requests after the first sharing a system
prompt). Servers' output goes to log files (``--logs``, else a temporary
directory, printed); a side that fails records its error and the log's tail
is printed. JSON on stdout, a table per scenario on stderr.

    python -m mlx_lm_patched.bench serve --shape 8b --runs 3
    python -m mlx_lm_patched.bench serve --shape tiny --scale 0.05 --reuse
"""

import argparse
import gc
import json
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

import mlx_lm_patched
from mlx_lm_patched.demo import tiny

from . import emit, header
from ._serve import (
    FRONTS,
    Prompts,
    Server,
    log_figures,
    median,
    merge,
    snapshot,
    stream,
    table,
    wait_written,
)

LLAMA_8B = {
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "intermediate_size": 14336,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
}
GEMMA3 = {"sliding_window": 1024, "sliding_window_pattern": 6}
GEMMA3.update(query_pre_attn_scalar=128, rope_local_base_freq=10000.0)
# name: (family, dtype, config overrides)
SHAPES = {
    "tiny": ("llama", "float32", {}),
    "tiny-gemma3": ("gemma3_text", "float32", {}),
    "8b": ("llama", "bfloat16", LLAMA_8B),
    "gemma3-8b": ("gemma3_text", "bfloat16", {**LLAMA_8B, **GEMMA3}),
}
# Token (and character) counts: the workload; --scale multiplies them.
COUNTS = {
    "system": 4096,
    "tool": 500,
    "long": 24000,
    "shared": 8000,
    "own": 300,
    "edited": 8900,
    "edit_chars": 5000,
}
COUNTS_UNSCALED = {
    "reply": 32,
    "turns": 8,
    "shared_requests": 6,
    "concurrent": 8,
    "concurrent_turns": 6,
}
MODIFIERS = {"dir": [], "bits8": ["--prompt-cache-bits", "8"]}
MODIFIERS["bits4"] = ["--prompt-cache-bits", "4"]
# The columns of each scenario's table.
TABLE = {
    "agent": ["prompt_tokens", "ttft_turn0_s", "ttft_turns_s", "cached", "total_s"],
    "repeated": ["prompt_tokens", "ttft_cold_s", "ttft_again_s", "cached_again"],
    "shared": ["prompt_tokens", "ttft_first_s", "ttft_s", "cached_tokens"],
    "edited": ["prompt_tokens", "shared_prefix_tokens", "cached_tokens"],
    "restart": [
        "ttft_cold_s",
        "ttft_sigterm_s",
        "cached_sigterm",
        "ttft_kill9_s",
        "cached_kill9",
    ],
    "concurrent": ["wall_s", "ttft_p50_s", "ttft_p95_s", "prompt_cache_bytes"],
}
TABLE["edited"] += ["ttft_first_s", "ttft_edited_s"]


def ask(ctx, server, messages, max_tokens=None):
    path, body = ctx.prompts.request(messages, max_tokens or ctx.args.reply)
    return stream(server.port, path, body, ctx.args.timeout)


def agent_loop(ctx, server, seed, system, turns, hits=False):
    """``turns`` requests: the system prompt and a task, then each reply
    and a tool result appended (``hits``: turns 1- are the scenario's)."""
    a, text = ctx.args, ctx.prompts.text
    messages = [
        {"role": "system", "content": system},
        {"role": "user", "content": text(a.tool, f"{seed}-task")},
    ]
    replies = []
    for t in range(turns):
        replies.append(ask(ctx, server, messages))
        if hits and t == 0:
            server.hits = server.mark()
        tool = f"Tool result: {text(a.tool, f'{seed}-tool{t}')}"
        messages += [
            {"role": "assistant", "content": replies[-1]["text"]},
            {"role": "user", "content": tool},
        ]
    return replies


def agent(ctx, server):
    system = ctx.prompts.text(ctx.args.system, "agent-system")
    replies = agent_loop(ctx, server, "agent", system, ctx.args.turns, hits=True)
    ttft = [r["ttft_s"] for r in replies]
    return {
        "prompt_tokens": replies[-1]["prompt_tokens"],
        "ttft_turn0_s": ttft[0],
        "ttft_turns_s": median(ttft[1:]),
        "cached": median([r["cached_tokens"] for r in replies[1:]]),
        "total_s": sum(r["total_s"] for r in replies),
        "ttft_s": ttft,
        "cached_tokens": [r["cached_tokens"] for r in replies],
    }


def repeated(ctx, server):
    messages = [{"role": "user", "content": ctx.prompts.text(ctx.args.long, "long")}]
    cold = ask(ctx, server, messages)
    server.hits = server.mark()
    again = ask(ctx, server, messages)
    return {
        "prompt_tokens": cold["prompt_tokens"],
        "ttft_cold_s": cold["ttft_s"],
        "ttft_again_s": again["ttft_s"],
        "cached_again": again["cached_tokens"],
        "total_s": cold["total_s"] + again["total_s"],
    }


def shared(ctx, server):
    a, text = ctx.args, ctx.prompts.text
    system = {"role": "system", "content": text(a.shared, "shared-system")}
    replies = []
    for i in range(a.shared_requests):
        own = {"role": "user", "content": text(a.own, f"own{i}")}
        replies.append(ask(ctx, server, [system, own]))
        if i == 0:
            server.hits = server.mark()
    return {
        "prompt_tokens": replies[0]["prompt_tokens"],
        "ttft_first_s": replies[0]["ttft_s"],
        "ttft_s": median([r["ttft_s"] for r in replies[1:]]),
        "cached_tokens": median([r["cached_tokens"] for r in replies[1:]]),
        "total_s": sum(r["total_s"] for r in replies),
    }


def conversation(ctx):
    """``(messages, edited)``: about ``--edited`` tokens in ``--tool``-token
    messages, and the same with a word inserted ``--edit-chars`` characters
    before its end."""
    a, text = ctx.args, ctx.prompts.text
    n = max(3, a.edited // a.tool) | 1  # odd: user first and last
    roles = ["user", "assistant"]
    messages = [
        {"role": roles[i % 2], "content": text(a.tool, f"edited{i}")} for i in range(n)
    ]
    edited, left = [dict(m) for m in messages], a.edit_chars
    for m in reversed(edited):
        if left <= len(m["content"]) or m is edited[0]:
            at = m["content"].rfind(" ", 0, max(0, len(m["content"]) - left)) + 1
            m["content"] = m["content"][:at] + "edited " + m["content"][at:]
            return messages, edited
        left -= len(m["content"])


def edited(ctx, server):
    messages, changed = conversation(ctx)
    first = ask(ctx, server, messages)
    server.hits = server.mark()
    second = ask(ctx, server, changed)
    a, b = ctx.prompts.tokens(messages), ctx.prompts.tokens(changed)
    common = next(
        (i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))
    )
    cached = second["cached_tokens"]
    return {
        "prompt_tokens": second["prompt_tokens"],
        "shared_prefix_tokens": common,
        "cached_tokens": cached,
        "reused": None if cached is None else round(cached / max(common, 1), 3),
        "ttft_first_s": first["ttft_s"],
        "ttft_edited_s": second["ttft_s"],
        "total_s": first["total_s"] + second["total_s"],
    }


def load_model(ctx, server, seed):
    """A new 32-token raw prompt (no chat template): a fresh server that
    answered ``/health`` before its model was loaded (upstream's) loads it
    for this one, so that only it waits."""
    body = {"prompt": ctx.prompts.text(32, seed), "max_tokens": 1}
    return stream(server.port, "/v1/completions", body, ctx.args.timeout)


def restart(ctx, server):
    """Cold, SIGTERM and restart, a disk hit; a second prompt, written,
    kill -9 and restart, a disk hit."""
    text, directory = ctx.prompts.text, server.cache_dir
    first = [{"role": "user", "content": text(ctx.args.long, "restart-a")}]
    second = [{"role": "user", "content": text(ctx.args.long, "restart-b")}]

    def load(i):
        return load_model(ctx, server, f"restart-load{i}")

    loaded = [load(0)]
    cold = ask(ctx, server, first)
    server.stop(signal.SIGTERM)
    start_sigterm = server.start()
    loaded.append(load(1))
    mark = server.mark()
    hit = ask(ctx, server, first)
    wait_written(directory, None, ctx.args.settle, server=server, mark=mark)
    before, mark = snapshot(directory), server.mark()
    cold_b = ask(ctx, server, second)
    written = wait_written(directory, before, ctx.args.settle, server=server, mark=mark)
    server.stop(signal.SIGKILL)
    start_kill9 = server.start()
    loaded.append(load(2))
    hit_b = ask(ctx, server, second)
    return {
        "prompt_tokens": cold["prompt_tokens"],
        "ttft_cold_s": cold["ttft_s"],
        "ttft_sigterm_s": hit["ttft_s"],
        "cached_sigterm": hit["cached_tokens"],
        "ttft_cold_second_s": cold_b["ttft_s"],
        "ttft_kill9_s": hit_b["ttft_s"],
        "cached_kill9": hit_b["cached_tokens"],
        "written_before_kill9": written,
        "start_sigterm_s": start_sigterm,
        "start_kill9_s": start_kill9,
        "ttft_load_s": [x["ttft_s"] for x in loaded],
    }


def concurrent(ctx, server):
    a = ctx.args
    system = ctx.prompts.text(a.system, "concurrent-system")
    loops, errors = [None] * a.concurrent, []

    def run(i):
        try:
            loops[i] = agent_loop(ctx, server, f"loop{i}", system, a.concurrent_turns)
        except Exception as e:
            errors.append(e)

    loaded = load_model(ctx, server, "concurrent-load")  # not one loop's wait
    threads = [threading.Thread(target=run, args=(i,)) for i in range(a.concurrent)]
    tic = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - tic
    if errors:
        raise errors[0]
    time.sleep(a.settle)  # idle: the server logs the bytes it holds at rest
    replies = [r for loop in loops for r in loop]
    ttft = [r["ttft_s"] for r in replies]
    return {
        "wall_s": wall,
        "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p95_s": float(np.percentile(ttft, 95)),
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in replies),
        "cached_tokens": sum(r["cached_tokens"] or 0 for r in replies),
        "ttft_load_s": loaded["ttft_s"],
    }


SCENARIOS = {
    "agent": agent,
    "repeated": repeated,
    "shared": shared,
    "edited": edited,
    "restart": restart,
    "concurrent": concurrent,
}


def side_flags(side):
    """``(front, flags, has a prompt-cache directory)`` of a side's name."""
    front, *mods = side.split("-")
    if front not in FRONTS or (front == "upstream" and mods):
        raise ValueError(f"unknown side {side!r}")
    flags = []
    for m in mods:
        if m not in MODIFIERS:
            raise ValueError(f"unknown side {side!r}: {m!r} is not one of {MODIFIERS}")
        flags += MODIFIERS[m]
    return FRONTS[front], flags, "dir" in mods


def make_server(args, model, side, tmp, name):
    front, flags, has_dir = side_flags(side)
    if args.breakdown:  # every side: at DEBUG each token's text is logged
        flags += ["--log-level", "DEBUG"]
    cache_dir = None
    if has_dir:
        cache_dir = Path(tempfile.mkdtemp(prefix=f"{side}-", dir=tmp))
        flags += ["--prompt-cache-dir", str(cache_dir)]
    log = Path(args.logs) / f"{name}.log"
    server = Server(front, model, flags + args.flags.split(), log, args.start_timeout)
    server.cache_dir = cache_dir
    return server


def discard(server):
    """Stop ``server`` and remove its prompt-cache directory."""
    server.stop()
    if server.cache_dir is not None:
        shutil.rmtree(server.cache_dir, ignore_errors=True)


def run_group(ctx, model, tmp, side, scenarios, name, results):
    """Run ``scenarios`` on one side, in one server (restarted where a
    scenario stops it or a failure ends it); each result appended to
    ``results[scenario][side]``."""
    server = make_server(ctx.args, model, side, tmp, name)
    try:
        for scenario in scenarios:
            out = results[scenario].setdefault(side, [])
            if scenario == "restart" and server.cache_dir is None:
                out.append({"skipped": "no --prompt-cache-dir"})
                continue
            print(f"bench serve: {name} {scenario}", file=sys.stderr, flush=True)
            mark, server.hits = server.mark(), None
            try:
                if not server.alive():
                    server.start()
                result = SCENARIOS[scenario](ctx, server)
            except Exception as e:
                result = {"error": f"{type(e).__name__}: {e}"[:500]}
                print(
                    f"{side} {scenario}: {result['error']}\n--- {server.log}:\n"
                    f"{server.tail()}",
                    file=sys.stderr,
                )
                server.stop(signal.SIGKILL)
            result.update(log_figures(server.since(mark)))
            if server.hits is not None:  # the requests the scenario's TTFT is of
                hits = log_figures(server.since(server.hits)).get("timing_ms")
                if hits:
                    result["hits_timing_ms"] = hits
            out.append(result)
    finally:
        discard(server)


def warmup(ctx, model, tmp, side):
    """A server of ``side`` that answers one ``--system``-token prompt and
    stops: MLX's kernels built (its PTX cache) and the weights read before
    any side's first request is timed, whichever side runs first. Its
    TTFT, or its error."""
    server = make_server(ctx.args, model, side, tmp, f"{side}-warmup")
    text = ctx.prompts.text(ctx.args.system, "warmup")
    try:
        server.start()
        return ask(ctx, server, [{"role": "user", "content": text}])["ttft_s"]
    except Exception as e:
        return f"{type(e).__name__}: {e}"[:500]
    finally:
        discard(server)


def model_dir(args, tmp):
    """``--model``, or the ``--shape`` model written (into ``--shape-dir``,
    kept and reused while its config is the same)."""
    if args.model:
        return Path(args.model)
    family, dtype, overrides = SHAPES[args.shape]
    path = Path(args.shape_dir or Path(tmp) / args.shape)
    config = tiny.model_config(family, **overrides)
    made = path / "config.json"
    if made.exists() and json.loads(made.read_text()) == config:
        return path
    print(f"bench serve: writing the {args.shape} model to {path}", file=sys.stderr)
    tiny.make_model_dir(path, family, dtype=dtype, **overrides)
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()  # the weights made here are the servers' to hold
    return path


def build_parser():
    p = argparse.ArgumentParser(
        prog="python -m mlx_lm_patched.bench serve",
        description="Upstream's server and ours over HTTP: time to first token.",
    )
    words = lambda s: s.split(",")  # noqa: E731
    p.add_argument("--model", help="an mlx-lm model directory")
    p.add_argument("--shape", choices=list(SHAPES), default="tiny")
    p.add_argument("--shape-dir", help="write (and reuse) the --shape model here")
    p.add_argument(
        "--sides", type=words, default=["upstream", "patched", "patched-dir"]
    )
    p.add_argument("--scenarios", type=words, default=list(SCENARIOS))
    p.add_argument("--runs", type=int, default=1, help="on fresh servers; medians")
    p.add_argument("--scale", type=float, default=1.0, help="times the token counts")
    for k, v in {**COUNTS, **COUNTS_UNSCALED}.items():
        p.add_argument(f"--{k.replace('_', '-')}", type=int, help=f"default {v}")
    p.add_argument(
        "--endpoint",
        choices=["chat", "completions"],
        help="default: chat where the tokenizer has a template",
    )
    p.add_argument("--reuse", action="store_true", help="one server a side and run")
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="every side at DEBUG (it slows decode, alike); the patched "
        "sides' timing: lines",
    )
    p.add_argument(
        "--warmup",
        action="store_true",
        help="first, each side's server answers one prompt and stops (kernel caches)",
    )
    p.add_argument("--flags", default="", help="more flags for every server")
    p.add_argument(
        "--settle",
        type=float,
        default=1.0,
        help="seconds the prompt-cache directory stays unchanged before kill -9; "
        "a server idles after its concurrent loops before its bytes are read",
    )
    p.add_argument("--timeout", type=float, default=900, help="seconds a request")
    p.add_argument(
        "--start-timeout", type=float, default=900, help="seconds a server start"
    )
    p.add_argument(
        "--logs", help="directory of the servers' logs (default: a new temporary one)"
    )
    p.add_argument("--out", help="also write the JSON here")
    return p


def main(argv=None):
    args = build_parser().parse_args(argv)
    for k, v in COUNTS.items():
        if getattr(args, k) is None:
            setattr(args, k, max(8, round(v * args.scale)))
    for k, v in COUNTS_UNSCALED.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    unknown = set(args.scenarios) - set(SCENARIOS)
    if unknown:
        raise SystemExit(
            f"unknown scenarios {sorted(unknown)}; known: {list(SCENARIOS)}"
        )
    try:
        for side in args.sides:
            side_flags(side)
    except ValueError as e:
        raise SystemExit(str(e))
    args.logs = args.logs or tempfile.mkdtemp(prefix="bench-serve-logs-")
    Path(args.logs).mkdir(parents=True, exist_ok=True)
    print(f"bench serve: servers' logs in {args.logs}", file=sys.stderr)
    results = {s: {} for s in args.scenarios}
    with tempfile.TemporaryDirectory(prefix="bench-serve-") as tmp:
        model = model_dir(args, tmp)
        ctx = argparse.Namespace(args=args, prompts=Prompts(model, args.endpoint))
        warm = {s: warmup(ctx, model, tmp, s) for s in args.sides if args.warmup}
        for r in range(args.runs):
            sides = args.sides if r % 2 == 0 else args.sides[::-1]
            if args.reuse:
                groups = [(side, args.scenarios, f"{side}-run{r}") for side in sides]
            else:
                groups = [
                    (side, [s], f"{side}-{s}-run{r}")
                    for s in args.scenarios
                    for side in sides
                ]
            for side, scenarios, name in groups:
                run_group(ctx, model, tmp, side, scenarios, name, results)
    result = header("serve", [p.name for p in mlx_lm_patched.PATCHES])
    result["config"] = {k: v for k, v in vars(args).items() if k != "out"}
    result["model"] = str(args.model or args.shape)
    result["endpoint"] = "chat" if ctx.prompts.chat else "completions"
    if warm:
        result["warmup_ttft_s"] = warm
    result["scenarios"] = {
        s: {side: merge(runs) for side, runs in by_side.items()}
        for s, by_side in results.items()
    }
    for s, sides in result["scenarios"].items():
        print(table(s, sides, TABLE[s]), file=sys.stderr)
    emit(result, args.out)
    return result


if __name__ == "__main__":
    main()
