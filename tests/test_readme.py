"""Every code block in README.md runs as written.

``<model>`` becomes a tiny local model (random weights, llama with sliding
and full layers). A block preceded by ``<!-- not run: why -->`` is skipped;
there are few, and each says why. Shell blocks run in bash from the
checkout's root with this interpreter first on ``PATH``; Python blocks run
in a fresh process in a temporary directory.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
BLOCK = re.compile(
    r"^(?:<!-- not run: (?P<why>.+?) -->\n)?```(?P<lang>\S*)\n(?P<code>.*?)^```$",
    re.S | re.M,
)
BLOCKS = [
    (m["lang"], m["code"], m["why"], README.count("\n", 0, m.start("lang")) + 1)
    for m in BLOCK.finditer(README)
    if m["lang"]  # a block without a language is a picture (the layout)
]


def test_readme_blocks_are_shell_or_python_and_few_are_skipped():
    assert {lang for lang, *_ in BLOCKS} == {"sh", "python"}
    assert len(BLOCKS) > 8
    assert sum(why is not None for *_, why, _ in BLOCKS) <= 5


@pytest.mark.parametrize(
    "lang, code, why", [b[:3] for b in BLOCKS], ids=[f"line{b[3]}" for b in BLOCKS]
)
def test_readme_block_runs(lang, code, why, tiny_model_dir, tmp_path):
    if why:
        pytest.skip(f"not run: {why}")
    code = code.replace("<model>", str(tiny_model_dir))
    bin_dir = os.path.dirname(sys.executable)
    env = {**os.environ, "PATH": bin_dir + os.pathsep + os.environ["PATH"]}
    if lang == "sh":
        cmd, cwd = ["bash", "-e", "-o", "pipefail", "-c", code], ROOT
    else:
        cmd, cwd = [sys.executable, "-c", code], tmp_path
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
