"""Every code block in README.md, and in the documents of ``DOCS``, runs as
written.

``<model>`` becomes a tiny local model (random weights, llama with sliding
and full layers). A block preceded by ``<!-- not run: why -->`` is skipped;
the README has few, and each says why. Shell blocks run in bash from the
checkout's root with this interpreter first on ``PATH``; Python blocks run
in a fresh process in a temporary directory; both offline
(``HF_HUB_OFFLINE=1``). The README's install block
(``pip install ".[cpu]"``) runs in a fresh virtual environment instead, from
a copy of the checkout: ``pip`` there is uv's (``uv pip``, from its cache
when it has every package, as ``make venv`` installs) where uv is at hand,
the environment's own pip otherwise; then the package is imported from that
environment. The quick start trains the demo model on first use (about 2
CPU-minutes, kept in ``~/.cache/mlx_lm_patched``).
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    "README.md",
    "docs/reference.md",
    "docs/patches.md",
    "docs/following-upstream.md",
    "docs/acceptance.md",
    "docs/development.md",
]
BLOCK = re.compile(
    r"^(?:<!-- not run: (?P<why>.+?) -->\n)?```(?P<lang>\S*)\n(?P<code>.*?)^```$",
    re.S | re.M,
)
INSTALL = re.compile(r'\Apip install "\.\[cpu\]"\n\Z')


def blocks(name):
    """(lang, code, why, line) of each block with a language in ``name``: a
    block without one is a picture (a layout, an output)."""
    text = (ROOT / name).read_text()
    return [
        (m["lang"], m["code"], m["why"], text.count("\n", 0, m.start("lang")) + 1)
        for m in BLOCK.finditer(text)
        if m["lang"]
    ]


BLOCKS = [(name, *b) for name in DOCS for b in blocks(name)]


def test_readme_blocks_are_shell_or_python_and_few_are_skipped():
    readme = blocks("README.md")
    assert {lang for lang, *_ in readme} == {"sh", "python"}
    assert len(readme) > 8
    assert sum(why is not None for *_, why, _ in readme) <= 5
    assert {lang for _, lang, *_ in BLOCKS} == {"sh", "python"}


def test_readme_has_the_install_block_and_no_internal_history():
    """A user's README: at most 300 lines, the install line that is tested,
    no issue numbers or commit hashes, every document it links exists, and
    the patches it counts are those ``status`` lists."""
    import mlx_lm_patched

    text = (ROOT / "README.md").read_text()
    count = re.search(r"^(\d+) patches, one concern each", text, re.M)
    assert count and int(count[1]) == len(mlx_lm_patched.status())
    assert len(text.splitlines()) <= 300
    assert sum(bool(INSTALL.match(code)) for _, code, *_ in blocks("README.md")) == 1
    history = r"(?<![\w/])#\d+|\bissues?\b|\bsessions?\b|\bcommit [0-9a-f]{7}"
    assert not re.search(history, text, re.I)
    for link in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", text):
        assert (ROOT / link).exists(), link


def install_in_fresh_venv(code, tmp_path):
    """``code`` (``pip install ".[cpu]"``) in a new virtual environment, from
    a copy of the checkout (the files git tracks or would): the package is
    then imported from that environment, not from this checkout."""
    src = tmp_path / "checkout"
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, map(os.fsdecode, listed)):
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, src / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    uv = shutil.which("uv") or shutil.which("uv", path=os.path.dirname(sys.executable))
    if uv:
        uv_pip = f'{uv} pip "$@" --python {venv / "bin" / "python"}'
        shim = f"#!/bin/sh\n{uv_pip} --offline 2>/dev/null || {uv_pip}\n"
        (bin_dir / "pip").write_text(shim)
        (bin_dir / "pip").chmod(0o755)
    path = os.pathsep.join([str(bin_dir), str(venv / "bin"), os.environ["PATH"]])
    env = {**os.environ, "PATH": path, "VIRTUAL_ENV": str(venv)}
    cmd = ["bash", "-e", "-o", "pipefail", "-c", code]
    done = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
    check = "import mlx_lm_patched, mlx.core as mx; print(mlx_lm_patched.__file__)"
    done = subprocess.run(
        [venv / "bin" / "python", "-c", check],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": ""},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(str(venv)), done.stdout


@pytest.mark.parametrize(
    "lang, code, why",
    [b[1:4] for b in BLOCKS],
    ids=[f"{b[0]}:line{b[4]}" for b in BLOCKS],
)
def test_readme_block_runs(lang, code, why, tiny_model_dir, tmp_path):
    if why:
        pytest.skip(f"not run: {why}")
    if INSTALL.match(code):
        return install_in_fresh_venv(code, tmp_path)
    code = code.replace("<model>", str(tiny_model_dir))
    bin_dir = os.path.dirname(sys.executable)
    path = bin_dir + os.pathsep + os.environ["PATH"]
    env = {**os.environ, "PATH": path, "HF_HUB_OFFLINE": "1"}  # no hub
    if lang == "sh":
        cmd, cwd = ["bash", "-e", "-o", "pipefail", "-c", code], ROOT
    else:
        cmd, cwd = [sys.executable, "-c", code], tmp_path
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"
