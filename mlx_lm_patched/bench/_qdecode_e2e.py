"""``qdecode``'s ``e2e`` part: each side in a process of its own
(``qdecode.run_side``), the sides' processes side by side taking turns,
and the summary of their rounds."""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np

SIDES = {
    "bf16": (None, "1"),
    "q8": (8, "1"),
    "q4": (4, "1"),
    "q8_old": (8, "0"),
    "q4_old": (4, "0"),
}


def _start_side(args, side):
    """A side's process (``run_side``): its model built, waiting for
    requests; its stderr kept in a file (``err``) for a failure's message."""
    env = dict(os.environ, MLX_LM_PATCHED_DECODE_KERNEL=SIDES[side][1])
    argv = [sys.executable, "-m", "mlx_lm_patched.bench.qdecode", "--side", side]
    argv += ["--decode", str(args.decode), "--chunk", str(args.chunk)]
    argv += ["--blocks", str(args.blocks), "--kt", str(args.kt)]
    argv += ["--pf", str(int(args.pf))]
    for k in ("layers", "hidden", "heads", "kv_heads", "intermediate"):
        argv += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    argv += ["--vocab", str(args.vocab)]
    err = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(
        argv, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err
    )
    proc.err = err
    return proc


def _ask(proc, ask):
    """A side's answer to one request (``run_side``), or its error."""
    try:
        proc.stdin.write((json.dumps(ask) + "\n").encode())
        proc.stdin.flush()
        for line in proc.stdout:
            if line.startswith(b"{"):
                return json.loads(line)
    except BrokenPipeError:
        pass
    proc.wait()
    proc.err.seek(0)
    return {"error": proc.err.read()[-500:]}


def _stop_sides(procs):
    """End the sides' processes (they leave their loop at stdin's end)."""
    for proc in procs.values():
        try:
            proc.stdin.close()
        except BrokenPipeError:  # gone already, a request unsent
            pass
        proc.wait()
        proc.err.close()


def _run_sides(args, procs, order, n):
    """One run of each side at a prompt of ``n`` tokens: every side
    prefills, then their decodes take turns ``--segment`` tokens at a time
    (each turn the other way round). A side's answers, or its error."""
    got = {s: _ask(procs[s], {"prompt": n}) | {"turns_s": []} for s in order}
    left = args.decode - 1  # the prefill gave the first token
    while left > 0:
        for side in order:
            if "error" not in got[side]:
                answer = _ask(procs[side], {"decode": min(args.segment, left)})
                if "error" in answer:
                    got[side] = answer
                else:
                    got[side]["turns_s"].append(answer["seconds"])
        left -= args.segment
        order = order[::-1]
    for side in order:
        if "error" not in got[side]:
            got[side] |= _ask(procs[side], {"end": True})
    return got


def e2e(args):
    """Each side in a process of its own, the sides' processes all started
    at once (each builds the model) and run side by side: a prompt at a
    time, the sides prefill, then decode in turns of ``--segment`` tokens,
    ``--rounds`` times (every other round in reverse). On the GPU machine
    the host ran in fast and slow spells of about a second (decode steps
    of 4.8 and 7.4 ms, bfloat16 at 4k), each vCPU its own: run on one core
    (``taskset -c N``), the sides' turns meet them alike (their rounds then
    moved together), where runs one after another met them by chance. A
    side's decode tokens/s and prefill seconds are its medians over the
    rounds, the rest its first round's; its ratios to bfloat16's are also
    taken turn by turn (``_paired``), which the targets read. A process's
    host ran at its own speed for all its rounds (H200, one call: q8 at
    0.95-0.96x bfloat16 at every length, paired, q4 at 0.99-1.01x): with
    ``--fresh`` each round starts the sides' processes anew, so their
    rounds' medians take several processes a side. The old road's
    sides run once, after the others (their tokens), each alone. With
    ``--out``, the finished rounds' summary goes to ``<out>.partial`` after
    each round (a run cut off keeps them), removed once all are done."""
    sides, partial = {}, args.out and args.out + ".partial"
    kernel = [s for s in args.sides if not s.endswith("_old")]
    procs = {s: _start_side(args, s) for s in kernel}
    try:
        for round_ in range(args.rounds):
            if round_ and partial:
                with open(partial, "w") as f:
                    summary = _e2e_summary(args, sides)
                    json.dump({"rounds_done": round_, "e2e": summary}, f)
            if round_ and args.fresh:
                _stop_sides(procs)
                procs = {s: _start_side(args, s) for s in kernel}
            for n in args.prompts:
                order = kernel[:: -1 if round_ % 2 else 1]
                for side, got in _run_sides(args, procs, order, n).items():
                    _add_round(sides, side, n, got)
    finally:
        _stop_sides(procs)
    for side in (s for s in args.sides if s.endswith("_old")):
        procs = {side: _start_side(args, side)}
        try:
            for n in args.prompts:
                _add_round(sides, side, n, _run_sides(args, procs, [side], n)[side])
        finally:
            _stop_sides(procs)
    if partial and os.path.exists(partial):
        os.remove(partial)
    return _e2e_summary(args, sides)


def _add_round(sides, side, n, got):
    """Keep a side's first figures for ``n``; medians over its rounds of
    decode tokens/s and prefill seconds."""
    row = sides.setdefault(side, {}).setdefault(str(n), got)
    if "decode_tok_s" in got and "decode_tok_s" in row:
        for k in ("decode_tok_s", "prefill_s", "turns_s"):
            row.setdefault(f"{k}_rounds", []).append(got[k])
        for k in ("decode_tok_s", "prefill_s"):
            row[k] = float(np.median(row[f"{k}_rounds"]))


def _paired(side, row, bf16):
    """A side's decode and prefill against bfloat16's turn by turn: the
    medians over the rounds' turns of bfloat16's seconds over the side's
    (the same tokens: tokens/s over tokens/s), and over the rounds of its
    prefill seconds over bfloat16's. Turns next to each other in time meet
    the host's spells alike, where whole rounds each met their own."""
    turns = [row.get("turns_s_rounds"), bf16.get("turns_s_rounds")]
    if not all(turns) or [len(x) for x in turns[0]] != [len(x) for x in turns[1]]:
        return {}
    decode = [b / a for a, b in zip(*(sum(t, []) for t in turns))]
    prefill = zip(row["prefill_s_rounds"], bf16["prefill_s_rounds"])
    return {
        f"{side}_over_bf16_decode_paired": round(float(np.median(decode)), 3),
        f"{side}_over_bf16_prefill_paired": round(
            float(np.median([a / b for a, b in prefill])), 3
        ),
    }


def _e2e_summary(args, sides):
    """Each length's sides, their ratios to bfloat16's and #29's targets."""
    out = {}
    for n in map(str, args.prompts):
        row = {s: dict(sides[s].get(n, sides[s])) for s in sides}
        bf16 = row.get("bf16", {})
        ratios, targets = {}, {}
        for s in ("q8", "q4", "q8_old", "q4_old"):
            r = row.get(s, {})
            if "decode_tok_s" not in r or "decode_tok_s" not in bf16:
                continue
            ratios[f"{s}_over_bf16_decode_tok_s"] = round(
                r["decode_tok_s"] / bf16["decode_tok_s"], 3
            )
            ratios[f"{s}_over_bf16_prefill_s"] = round(
                r["prefill_s"] / bf16["prefill_s"], 3
            )
            ratios[f"{s}_over_bf16_prefill_peak"] = round(
                r["prefill_peak"] / bf16["prefill_peak"], 3
            )
            if not s.endswith("_old"):  # the old road ran alone
                ratios.update(_paired(s, r, bf16))
            old = row.get(f"{s}_old", {})
            if "tokens" in old:
                same = r["tokens"] == old["tokens"]
                first = next(
                    (
                        i
                        for i, (a, b) in enumerate(zip(r["tokens"], old["tokens"]))
                        if a != b
                    ),
                    None,
                )
                ratios[f"{s}_tokens_equal_old_road"] = same
                ratios[f"{s}_first_differing_token"] = first
                if first is not None and "top2_margins" in old:
                    # The old road's top-2 log-probability gap where they part.
                    ratios[f"{s}_old_road_top2_margin_there"] = old["top2_margins"][
                        first
                    ]
                    ratios["old_road_top2_margin_median"] = float(
                        np.median(old["top2_margins"])
                    )
                bound = 0.9 if int(n) < 16000 else 1.0
                # Paired where the turns paired up, else the whole runs'.
                decode = ratios.get(
                    f"{s}_over_bf16_decode_paired",
                    ratios[f"{s}_over_bf16_decode_tok_s"],
                )
                prefill = ratios.get(
                    f"{s}_over_bf16_prefill_paired", ratios[f"{s}_over_bf16_prefill_s"]
                )
                targets[s] = {
                    f"decode_ge_{bound}x_bf16": decode >= bound,
                    "prefill_le_1.1x_bf16": prefill <= 1.1,
                    "prefill_peak_lt_bf16": ratios[f"{s}_over_bf16_prefill_peak"] < 1,
                    "tokens_equal_old_road": same,
                }
        for r in row.values():
            r.pop("turns_s", None)
            r.pop("tokens", None)
            r.pop("top2_margins", None)
        out[n] = {"sides": row, "ratios": ratios, "targets": targets}
    return out
