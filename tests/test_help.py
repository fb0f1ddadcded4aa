"""Every front's ``--help`` names the program, says what it is here and
shows its defaults; the flags README's flags table (``| flag | front |
patched |``) lists are in each front's help it names, saying what the table
and ``FACTS`` say of them."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

FRONTS = ["generate", "chat", "server", "cache_prompt", "benchmark"]
README = Path(__file__).parent.parent / "README.md"
# What a flag's help must say, on every front that has the flag.
FACTS = {
    "--max-kv-size": ["keep=4", "rings"],
    "--kv-bits": ["2, 3, 4, 5, 6 or 8"],
    "--kv-group-size": ["(default: 64)"],
    "--quantized-kv-start": ["(default: 5000)"],
    "--draft-model": ["--max-kv-size"],
    "--prompt-cache-bytes": ["2G", "running batch"],
    "--prompt-cache-dir": ["as it is made", "after a restart"],
    "--prompt-cache-disk-bytes": ["(default: 16G)"],
    "--prompt-cache-queue-bytes": ["(default: 1G)"],
    "--prompt-cache-size": ["(default: 10)"],
    "--prompt-cache-mode": ["(default: 600", "700", "umask"],
    "--prompt-cache-bits": ["at rest"],
    "--prompt-cache-group-size": ["(default: 64)"],
    "--warmup-tokens": ["plus 256", "0: none"],
}
# Upstream's words for its own programs.
UPSTREAM = ["LLM inference script", "LLM benchmarking script", "MLX Http Server"]


@pytest.fixture(scope="module")
def helps():
    """``front -> --help`` text, each run as a user runs it."""
    out = {}
    for front in FRONTS:
        cmd = [sys.executable, "-m", f"mlx_lm_patched.{front}", "--help"]
        env = {**os.environ, "COLUMNS": "1000"}  # no line breaks in a word
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr
        out[front] = done.stdout
    return out


def options(text):
    """``flag -> its help`` (one line, whitespace folded) of a ``--help`` text."""
    out, entry = {}, None
    for line in text.split("options:", 1)[1].splitlines():
        if re.match(r"  -", line):
            entry = [line]
            for flag in re.findall(r"(?:^|[ ,])(--?[\w-]+)", line.split("  ")[1]):
                out[flag] = entry
        elif entry is not None:
            entry.append(line)
    return {flag: " ".join(" ".join(e).split()) for flag, e in out.items()}


def readme_rows():
    """``(flags, fronts, patched)`` of each row of README's flags table."""
    rows, inside = [], False
    for line in README.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.lstrip().startswith("|"):
            inside = False
        elif [c.lower() for c in cells[:3]] == ["flag", "front", "patched"]:
            inside = True
        elif inside and len(cells) >= 3 and not set(cells[0]) <= set("-: "):
            fronts = [f for f in FRONTS if re.search(rf"\b{f}\b", cells[1])]
            rows.append((re.findall(r"--[a-z][\w-]*", cells[0]), fronts, cells[2]))
    return rows


@pytest.mark.parametrize("front", FRONTS)
def test_help_names_the_program_and_shows_the_defaults(helps, front):
    text = helps[front]
    assert text.startswith(f"usage: mlx_lm_patched.{front} "), text[:200]
    description = text.split("options:")[0].split("\n\n", 1)[1]
    assert "mlx-lm-patched" in " ".join(description.split()), description
    for words in UPSTREAM + ["mlx_lm.generate", "mlx_lm.server"]:
        assert words not in text, words
    for flag, facts in FACTS.items():
        for fact in facts if flag in options(text) else []:
            assert fact in options(text)[flag], (flag, options(text)[flag])


def test_every_default_is_shown(helps):
    """A flag whose value is not given has a default its help shows (the
    ones defaulting to none say so, or name what happens without them)."""
    import argparse
    import importlib

    from mlx_lm_patched._front import described

    for front in ["generate", "chat", "cache_prompt", "benchmark"]:
        module = importlib.import_module(f"mlx_lm.{front}")
        parser = described(module.setup_arg_parser, front)()
        for action in parser._actions:
            default = action.default
            if default is None or default is False or default == argparse.SUPPRESS:
                continue
            if isinstance(default, (str, list, tuple)) and not default:
                continue
            shown = options(helps[front])[action.option_strings[0]]
            assert "default" in shown.lower(), (front, shown)


def test_readme_flags_table_matches_every_front_help(helps):
    rows = readme_rows()
    assert rows, f"no | flag | front | patched | table in {README}"
    for flags, fronts, patched in rows:
        assert flags and fronts, (flags, fronts, patched)
        # The defaults and keep the table names, in one of the row's flags.
        facts = re.findall(r"default (\w+)", patched)
        facts += re.findall(r"keep=\d+", patched)
        for front in fronts:
            helped = options(helps[front])
            for flag in flags:
                assert flag in helped, f"{flag} not in mlx_lm_patched.{front} --help"
            said = " ".join(helped[f] for f in flags)
            for fact in facts:
                assert fact in said, (front, flags, fact, said)
