"""pytest plugin (``-p tools.pytest_plugin``) for runs of upstream's tests
(``suite``): checks which mlx-lm the run is testing and records each test's
outcome into the JSON file ``REPORT_ENV`` names. Inactive without it."""

import json
import os
from pathlib import Path
from typing import Dict

REPORT_ENV = "MLX_LM_PATCHED_UPSTREAM_REPORT"
SOURCE_ENV = "MLX_LM_PATCHED_UPSTREAM_SOURCE"  # the tree mlx_lm must come from
MONKEYPATCH_ENV = "MLX_LM_PATCHED_UPSTREAM_MONKEYPATCH"  # "1": apply PATCHES
RANK = {"passed": 0, "xfailed": 0, "skipped": 1, "failed": 2, "error": 2}

_results: Dict[str, dict] = {}


def _active() -> bool:
    return bool(os.environ.get(REPORT_ENV))


def pytest_configure(config):
    if not _active():
        return
    import mlx_lm

    source = os.environ.get(SOURCE_ENV)
    if source and not mlx_lm.__file__.startswith(str(Path(source).resolve())):
        raise RuntimeError(f"mlx_lm imported from {mlx_lm.__file__}, not {source}")
    applied = []
    if os.environ.get(MONKEYPATCH_ENV) == "1":
        import mlx_lm_patched
        from mlx_lm_patched import _apply

        applied = list(_apply._applied)
        expected = [p.name for p in mlx_lm_patched.PATCHES]
        if applied != expected:
            raise RuntimeError(f"patches applied {applied}, expected {expected}")
    _results["__applied__"] = {"outcome": "meta", "reason": ",".join(applied)}


def _reason(report) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr or "")
    text = text.strip().splitlines()[0] if text.strip() else ""
    ctx = getattr(report, "context", None)
    msg = getattr(ctx, "msg", None) if ctx is not None else None
    kwargs = getattr(ctx, "kwargs", None) if ctx is not None else None
    if msg or kwargs:
        text = f"[subtest {msg or ''} {kwargs or ''}".rstrip() + f"] {text}"
    return text[:300]


def _record(nodeid: str, outcome: str, reason: str):
    rec = _results.setdefault(nodeid, {"outcome": "passed", "reason": ""})
    if RANK[outcome] > RANK[rec["outcome"]] or (
        outcome == "xfailed" and rec["outcome"] == "passed"
    ):
        rec["outcome"], rec["reason"] = outcome, reason


def pytest_runtest_logreport(report):
    if not _active():
        return
    if hasattr(report, "wasxfail"):
        outcome = "xfailed" if report.skipped else "passed"
        _record(report.nodeid, outcome, report.wasxfail)
    elif report.failed:
        outcome = "failed" if report.when == "call" else "error"
        _record(report.nodeid, outcome, _reason(report))
    elif report.skipped:
        _record(report.nodeid, "skipped", _reason(report))
    else:
        _record(report.nodeid, "passed", "")


def pytest_collectreport(report):
    if _active() and report.failed:
        _record(report.nodeid or "<collection>", "error", _reason(report))


def pytest_sessionfinish(session, exitstatus):
    if _active():
        path = Path(os.environ[REPORT_ENV])
        path.write_text(json.dumps(_results, indent=1, sort_keys=True))
