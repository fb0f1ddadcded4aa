"""Upstream's own test suite, offline, on one mlx-lm against another.

A run is pytest over upstream's test files (from a given ``tests/``
directory: the sdist's, or one the series patched), with ``mlx_lm``
imported from a given source tree (the sdist's, or one the series patched)
and, optionally, ``PATCHES`` monkeypatched in. Hub models are the tiny
stand-ins of ``hub``; ``pytest_plugin`` records every outcome. Two runs are
compared test by test: none may do worse than the unpatched run, and each
test the series adds must pass.
"""

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Sequence, Set, Tuple

from mlx_lm_patched._registry import UPSTREAM_VERSION
from mlx_lm_patched.demo import tiny

from . import ROOT, hub, pytest_plugin
from .hub import build_hub_standins, hub_cache
from .pytest_plugin import MONKEYPATCH_ENV, RANK, REPORT_ENV, SOURCE_ENV
from .sdist import CACHE, fresh_tree

# Upstream test files that exercise the caches and run offline once the hub
# model they load is replaced by a tiny local one.
TEST_FILES = (
    "test_prompt_cache.py",
    "test_models.py",
    "test_generate.py",
    "test_server.py",
    "test_muse_spark.py",
)


def default_files() -> List[str]:
    """``TEST_FILES``, less test_server.py where ``requests`` is missing."""
    files = list(TEST_FILES)
    if importlib.util.find_spec("requests") is None:
        print("leaving out test_server.py, which needs `requests`", file=sys.stderr)
        files.remove("test_server.py")
    return files


@dataclass
class Run:
    label: str
    results: Dict[str, dict]
    returncode: int
    log: Path

    @property
    def applied(self) -> str:
        return self.results.get("__applied__", {}).get("reason", "")

    def tests(self) -> Dict[str, dict]:
        return {k: v for k, v in self.results.items() if k != "__applied__"}


def run_tests(
    label: str,
    work: Path,
    tests_dir: Path,
    source: Path,
    monkeypatch: bool = False,
    files: Sequence[str] = TEST_FILES,
    extra: Sequence[str] = (),
    timeout: float = 1800,
) -> Run:
    """pytest over ``files`` of ``tests_dir``, ``mlx_lm`` imported from the
    tree ``source`` (with ``PATCHES`` applied if ``monkeypatch``); the hub
    stand-ins must be built under ``work`` already."""
    report, log = work / f"{label}.json", work / f"{label}.log"
    env = dict(os.environ)
    path = [str(source), str(ROOT), env.get("PYTHONPATH", "")]
    env.update(
        {
            REPORT_ENV: str(report),
            SOURCE_ENV: str(source),
            MONKEYPATCH_ENV: "1" if monkeypatch else "0",
            "MLX_LM_PATCHED_APPLY": "1" if monkeypatch else "0",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "HF_HOME": str(hub_cache(work).parent),
            "HF_HUB_CACHE": str(hub_cache(work)),
            "PYTHONPATH": os.pathsep.join(filter(None, path)),
        }
    )
    cmd = [sys.executable, "-m", "pytest", "-p", "tools.pytest_plugin"]
    cmd += ["-p", "no:cacheprovider", "-q", "--no-header", "-rN", "--rootdir=."]
    cmd += ["--continue-on-collection-errors", *extra, *files]
    with open(log, "w") as f:
        try:
            rc = subprocess.run(
                cmd,
                cwd=tests_dir,
                env=env,
                stdout=f,
                stderr=subprocess.STDOUT,
                timeout=timeout,
            ).returncode
        except subprocess.TimeoutExpired:
            rc = -1
    results = json.loads(report.read_text()) if report.exists() else {}
    return Run(label, results, rc, log)


def defined_tests(tests_dir: Path, files: Sequence[str]) -> Set[str]:
    """The unittest-style test ids ``files`` define (``file::Class::test``)."""
    found = set()
    for file in files:
        path = tests_dir / file
        if not path.exists():
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                found |= {
                    f"{file}::{node.name}::{f.name}"
                    for f in node.body
                    if isinstance(f, ast.FunctionDef) and f.name.startswith("test")
                }
    return found


def _counts(tests: Dict[str, dict], file: str) -> Counter:
    return Counter(v["outcome"] for k, v in tests.items() if k.split("::")[0] == file)


def _fmt(c: Counter) -> str:
    failed = c["failed"] + c["error"]
    passed = c["passed"] + c["xfailed"]
    return f"{passed:4d} passed {failed:3d} failed {c['skipped']:3d} skipped"


def compare_runs(
    files: Sequence[str], base: Run, patched: Run, removed: Set[str] = frozenset()
) -> Tuple[List[str], str]:
    """(regressions, report text): no test may do worse in ``patched`` than
    in ``base``, and a test only ``patched`` ran must pass; ``removed``:
    tests the series deletes on purpose."""
    a, b = base.tests(), patched.tests()
    lines = [
        f"upstream tests of mlx-lm {UPSTREAM_VERSION}, offline (tiny stand-in models)",
        f"{base.label} vs {patched.label}; patches monkeypatched in the "
        f"{patched.label} run: {patched.applied or 'none'}",
        f"{'file':24} {base.label:>34}   {patched.label:>34}",
    ]
    for file in files:
        lines.append(f"{file:24} {_fmt(_counts(a, file))}   {_fmt(_counts(b, file))}")
    worse, better, both, added, gone = [], [], [], [], []
    for nodeid in sorted(set(a) | set(b)):
        ra, rb = a.get(nodeid), b.get(nodeid)
        if rb is None:
            if nodeid in removed:
                gone.append(nodeid)
            else:
                worse.append(f"{nodeid}: {ra['outcome']} in {base.label}, not run")
        elif ra is None:
            if RANK[rb["outcome"]] > 0:
                worse.append(f"{nodeid}: new, {rb['outcome']}: {rb['reason']}")
            else:
                added.append(nodeid)
        elif RANK[rb["outcome"]] > RANK[ra["outcome"]]:
            worse.append(
                f"{nodeid}: {ra['outcome']} in {base.label}, "
                f"{rb['outcome']} in {patched.label}: {rb['reason']}"
            )
        elif RANK[rb["outcome"]] < RANK[ra["outcome"]]:
            better.append(f"{nodeid}: {ra['outcome']} -> {rb['outcome']}")
        elif RANK[ra["outcome"]] == 2:
            why = ra["reason"]
            if rb["reason"] != ra["reason"]:
                why += f" | {patched.label}: {rb['reason']}"
            both.append(f"{nodeid}: {why}")
    for title, items in (
        (f"WORSE in {patched.label} than in {base.label}", worse),
        (f"better in {patched.label}", better),
        ("added by the series, passing", added),
        ("removed by the series", gone),
        ("failing in both runs", both),
    ):
        lines.append(f"{title}: {len(items)}")
        lines += [f"  {item}" for item in items]
    for run in (base, patched):
        if run.returncode not in (0, 1):
            lines.append(f"note: the {run.label} run exited {run.returncode}")
    return worse, "\n".join(lines)


def tree_with(dest: Path, files: Dict[str, str]) -> Path:
    """A copy of the pinned sdist at ``dest`` with ``files`` (sdist-relative
    path -> text) written over it."""
    fresh_tree(dest)
    for rel, text in files.items():
        (dest / rel).write_text(text)
    return dest


def _baseline_key(files: Sequence[str], extra: Sequence[str]) -> str:
    """What the unpatched run's outcomes depend on: the pinned sdist, the
    test selection, the interpreter and every installed distribution, and
    the code that builds the stand-ins and runs the tests."""
    parts = [UPSTREAM_VERSION, *files, "--", *extra, sys.version]
    dists = importlib.metadata.distributions()
    parts += sorted(f"{d.metadata['Name']}=={d.version}" for d in dists)
    for module in (hub, pytest_plugin, sys.modules[__name__], tiny):
        parts.append(Path(module.__file__).read_text())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def unpatched_run(
    work: Path, pristine: Path, files: Sequence[str], extra: Sequence[str]
) -> Run:
    """The run on the pristine sdist, reused from ``.upstream/`` when nothing
    it depends on changed (``check-patches`` and ``test`` both need it)."""
    cached = CACHE / f"baseline-{_baseline_key(files, extra)}.json"
    if cached.exists():
        return Run("unpatched", json.loads(cached.read_text()), 0, cached)
    run = run_tests(
        "unpatched", work, pristine / "tests", pristine, False, files, extra
    )
    if run.tests() and run.returncode in (0, 1):
        cached.write_text(json.dumps(run.results, indent=1, sort_keys=True))
    return run


def against_unpatched(
    work: Path,
    label: str,
    tree: Path,
    monkeypatch: bool,
    files: Sequence[str],
    extra: Sequence[str] = (),
) -> Tuple[List[str], str]:
    """Upstream's suite run on the pristine sdist (its tests, its source) and
    on ``tree`` (its tests, its source, ``PATCHES`` applied if
    ``monkeypatch``), compared: (regressions, report)."""
    build_hub_standins(work)
    pristine = tree_with(work / "unpatched", {})
    runs = [
        unpatched_run(work, pristine, files, extra),
        run_tests(label, work, tree / "tests", tree, monkeypatch, files, extra),
    ]
    for run in runs:
        if not run.tests():
            tail = run.log.read_text()[-3000:]
            return [f"the {run.label} run reported nothing"], f"{run.log}:\n{tail}"
    names = [f.split("::")[0] for f in files]
    removed = defined_tests(pristine / "tests", names) - defined_tests(
        tree / "tests", names
    )
    return compare_runs(names, *runs, removed=removed)
