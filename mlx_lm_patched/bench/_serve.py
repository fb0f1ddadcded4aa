"""What ``bench serve`` drives servers with: server processes stopped by
their PID, a streaming OpenAI-style client timing the first content chunk,
prompts of about a given number of tokens, and the figures the servers'
logs hold (prompt-cache bytes, which tier served a prompt, per-request
timing lines); the medians of runs, and tables."""

import http.client
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from mlx_lm_patched.demo import tiny

FRONTS = {"upstream": "mlx_lm.server", "patched": "mlx_lm_patched.server"}
# Upstream logs GB with two decimals; the patched server adds the bytes.
CACHE_BYTES = re.compile(
    r"Prompt (?:Cache|cache at rest): (\d+) sequences, ([\d.]+) GB(?: \((\d+) B\))?"
)
TIER = re.compile(r"Prompt cache (miss|memory hit|disk hit): (\d+) of (\d+) tokens")
# The breakdown the patched server logs at DEBUG: "prompt-cache timing:
# tokenize=0.4ms lookup=1.2ms ...": every key=value(ms) pair of such a line.
TIMING_PAIR = re.compile(r"(\w+)=([-\d.]+)\s*(?:ms)?")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m <front> --model model *flags`` on 127.0.0.1; its output
    appended to ``log`` (a restart keeps writing there)."""

    def __init__(self, front, model, flags, log, start_timeout=600):
        self.front, self.model, self.flags = front, model, list(map(str, flags))
        self.log, self.start_timeout, self.proc = Path(log), start_timeout, None
        self.hits = None  # a mark: the log of the requests a scenario times

    def start(self):
        """Start and wait until ``/health`` answers; the seconds that took."""
        self.port = free_port()
        cmd = [sys.executable, "-m", self.front, "--model", str(self.model)]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *self.flags]
        tic = time.perf_counter()
        with open(self.log, "a") as log:
            log.write(f"### {' '.join(cmd[1:])}\n")
            log.flush()
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        while time.perf_counter() - tic < self.start_timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.front} exited {self.proc.returncode}")
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return time.perf_counter() - tic
            except OSError:
                pass
            finally:
                conn.close()
            time.sleep(0.1)
        self.stop(signal.SIGKILL)
        raise TimeoutError(f"{self.front} not healthy after {self.start_timeout} s")

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig=signal.SIGTERM, timeout=300):
        """Stop with ``sig`` (SIGTERM: the disk tier drains); SIGKILL after
        ``timeout`` seconds."""
        if self.alive():
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=60)

    def mark(self):
        return self.log.stat().st_size if self.log.exists() else 0

    def since(self, mark):
        with open(self.log, errors="replace") as f:
            f.seek(mark)
            return f.read()

    def tail(self, n=3000):
        return self.log.read_text(errors="replace")[-n:] if self.log.exists() else ""


def stream(port, path, body, timeout=600):
    """POST ``body`` streamed (temperature 0, usage included) and read the
    events: ``ttft_s`` (the first chunk with content; the first chunk if
    none has any), ``total_s``, the reply's text, and the usage's token
    counts (``cached_tokens`` None where the server reports none)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    body["temperature"] = 0
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    tic = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{path}: HTTP {response.status}: {response.read()[:300]}")
    first = first_content = None
    text, usage = [], {}
    for line in response:
        if not line.startswith(b"data: "):
            continue  # keepalives are SSE comments
        data = line[6:].strip()
        if data == b"[DONE]":
            break
        event, now = json.loads(data), time.perf_counter()
        usage = event.get("usage") or usage
        for choice in event.get("choices", []):
            first = first or now
            content = choice.get("delta", {}).get("content") or choice.get("text")
            if content:
                first_content = first_content or now
                text.append(content)
    total = time.perf_counter() - tic
    conn.close()
    details = usage.get("prompt_tokens_details") or {}
    return {
        "ttft_s": (first_content or first or time.perf_counter()) - tic,
        "total_s": total,
        "text": "".join(text),
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": details.get("cached_tokens"),
    }


class Prompts:
    """Texts of about ``n`` tokens of the model's tokenizer, and requests:
    ``/v1/chat/completions`` where the tokenizer has a chat template,
    ``/v1/completions`` of plainly joined messages otherwise."""

    def __init__(self, model, endpoint=None):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model))
        self.tokenizer.model_max_length = sys.maxsize  # counting, not running
        has_template = getattr(self.tokenizer, "chat_template", None) is not None
        self.chat = endpoint == "chat" if endpoint else has_template
        self.words = sorted(set(tiny.TEXT.split()))
        self._texts = {}

    def count(self, text):
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def text(self, n, seed):
        """Seeded random words, as many as make at most ``n`` tokens (texts
        of other seeds share no prefix)."""
        if (n, seed) not in self._texts:
            rng = random.Random(seed)
            words = [f"[{seed}]"] + [rng.choice(self.words) for _ in range(n + 8)]
            lo, hi = 1, len(words)
            while lo < hi:  # the most words within n tokens
                mid = (lo + hi + 1) // 2
                ok = self.count(" ".join(words[:mid])) <= n
                lo, hi = (mid, hi) if ok else (lo, mid - 1)
            self._texts[n, seed] = " ".join(words[:lo])
        return self._texts[n, seed]

    def render(self, messages):
        if self.chat:
            return None
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n\n".join(lines + ["assistant:"])

    def tokens(self, messages):
        """The prompt's tokens, as the server builds them (special tokens
        included)."""
        if self.chat:
            out = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True
            )
            return list(out["input_ids"] if hasattr(out, "keys") else out)
        return self.tokenizer.encode(self.render(messages))

    def request(self, messages, max_tokens):
        """``(path, body)`` of a request for ``messages``."""
        if self.chat:
            return "/v1/chat/completions", {
                "messages": messages,
                "max_tokens": max_tokens,
            }
        return "/v1/completions", {
            "prompt": self.render(messages),
            "max_tokens": max_tokens,
        }


def log_figures(text):
    """What a server's log since a mark says: the last and largest
    prompt-cache size it logged (bytes; upstream's to 10 MB), how many
    prompts each tier served, and the values of each ``timing:`` key."""
    sizes = [
        int(m[3]) if m[3] else round(float(m[2]) * 1e9)
        for m in CACHE_BYTES.finditer(text)
    ]
    out = {}
    if sizes:
        out["prompt_cache_bytes"] = sizes[-1]
        out["prompt_cache_bytes_max"] = max(sizes)
    tiers = {}
    for m in TIER.finditer(text):
        tiers[m[1]] = tiers.get(m[1], 0) + 1
    if tiers:
        out["tiers"] = tiers
    timing = {}
    for line in text.splitlines():
        if "timing:" in line:
            for key, value in TIMING_PAIR.findall(line.split("timing:", 1)[1]):
                timing.setdefault(key, []).append(float(value))
    if timing:
        out["timing_ms"] = timing
    return out


def snapshot(directory):
    """``(name, size)`` of every file under ``directory``, sorted."""
    return sorted(
        (str(p), p.stat().st_size) for p in Path(directory).rglob("*") if p.is_file()
    )


# The disk tier's line as it takes an entry off its queue.
QUEUED = re.compile(r"Prompt cache: (?:wrote|did not write) an entry .*, (\d+) queued")


def wait_written(directory, before, settle=1.0, timeout=120, server=None, mark=0):
    """Wait until ``directory`` holds something ``before`` did not, no
    temporary file, nothing changed for ``settle`` seconds and, with
    ``server``, its log since ``mark`` saying nothing is left queued: the
    disk tier wrote what it had queued (then a kill -9 loses nothing; a
    large entry's copy to host can outlast ``settle``)."""
    deadline = time.monotonic() + timeout
    last = snapshot(directory)
    while time.monotonic() < deadline:
        time.sleep(settle)
        now = snapshot(directory)
        written = now != before and not any(n.endswith(".tmp") for n, _ in now)
        left = QUEUED.findall(server.since(mark)) if server is not None else []
        if written and now == last and (not left or left[-1] == "0"):
            return True
        last = now
    return False


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def merge(outs, per_run=True):
    """The runs of one scenario and side: medians (lists element-wise;
    ``timing_ms``: every value of every run, medians per key), and each
    run's figures (``per_run``: medians of runs from several invocations)."""
    ok = [o for o in outs if "error" not in o and "skipped" not in o]
    if not ok:
        return outs[0]
    result = {}
    for key, value in ok[0].items():
        values = [o.get(key) for o in ok]
        if key.endswith("timing_ms"):
            pooled = {}
            for v in values:
                for k, ms in (v or {}).items():
                    pooled.setdefault(k, []).extend(ms)
            result[key] = {k: round(median(ms), 3) for k, ms in pooled.items()}
            result[key[:-3] + "_lines"] = max(len(ms) for ms in pooled.values())
        elif isinstance(value, dict):
            result[key] = merge([v or {} for v in values], per_run=False)
        elif isinstance(value, list) and all(len(v) == len(value) for v in values):
            result[key] = [_round(median(x)) for x in zip(*values)]
        elif isinstance(value, (bool, str, list)) or value is None:
            result[key] = value
        else:
            result[key] = _round(median(values))
    if len(ok) < len(outs):
        result["failed_runs"] = [o["error"] for o in outs if "error" in o]
    if per_run and len(outs) > 1:
        result["per_run"] = outs
    return result


def _round(v):
    if isinstance(v, float):  # a median of counts: a whole number
        return int(v) if v.is_integer() else round(v, 4)
    return v


def table(scenario, sides, keys):
    """A scenario's table: a row a side, a column a key of its results."""
    rows = [["side"] + keys]
    for side, r in sides.items():
        if "error" in r or "skipped" in r:
            rows.append([side, r.get("error") or r["skipped"]])
            continue
        rows.append([side] + ["-" if r.get(k) is None else str(r[k]) for k in keys])
        for key in ("timing_ms", "hits_timing_ms"):
            if key in r:
                name = f"  {key[:-3].replace('_', ' ')} ms"
                rows.append([name] + [f"{k}={v}" for k, v in r[key].items()])
    widths = [
        max(len(row[i]) for row in rows if i < len(row)) for i in range(len(keys) + 1)
    ]
    lines = [f"{scenario}:"]
    for row in rows:
        cells = [
            c.ljust(widths[i]) if i < len(widths) else c for i, c in enumerate(row)
        ]
        lines.append("  " + "  ".join(cells).rstrip())
    return "\n".join(lines)
