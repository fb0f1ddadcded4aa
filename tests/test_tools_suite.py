"""Upstream's own test suite as tools/ runs it: on the pristine sdist, on the
patched source, and monkeypatched, compared test by test."""

from pathlib import Path

import pytest

import mlx_lm_patched
from tools import all_patches
from tools.hub import build_hub_standins
from tools.series import generate, is_source
from tools.suite import (
    Run,
    _baseline_key,
    compare_runs,
    defined_tests,
    run_tests,
    tree_with,
)


def _run(label, results):
    return Run(label, results, 1, Path("/dev/null"))


def _outcomes(**tests):
    return {
        f"t.py::T::{name}": {"outcome": o, "reason": r}
        for name, (o, r) in tests.items()
    }


def test_compare_runs_flags_regressions_and_failing_new_tests():
    base = _run(
        "unpatched",
        _outcomes(
            a=("passed", ""),
            b=("failed", "boom"),
            c=("failed", "both"),
            d=("skipped", "no metal"),
            e=("passed", ""),
            gone=("passed", ""),
        ),
    )
    patched = _run(
        "patched",
        _outcomes(
            a=("failed", "regressed"),
            b=("passed", ""),
            c=("error", "both"),
            d=("skipped", "no metal"),
            new=("passed", ""),
            new_broken=("failed", "nope"),
        ),
    )
    worse, text = compare_runs(["t.py"], base, patched, removed={"t.py::T::gone"})
    assert worse == [
        "t.py::T::a: passed in unpatched, failed in patched: regressed",
        "t.py::T::e: passed in unpatched, not run",
        "t.py::T::new_broken: new, failed: nope",
    ]
    assert "failing in both runs: 1\n  t.py::T::c: both" in text
    assert "added by the series, passing: 1\n  t.py::T::new" in text
    assert "removed by the series: 1\n  t.py::T::gone" in text
    assert "better in patched: 1\n  t.py::T::b: failed -> passed" in text
    assert "t.py    " in text and "3 passed   2 failed   1 skipped" in text


def test_defined_tests_are_read_from_the_source(sdist):
    ids = defined_tests(sdist / "tests", ["test_prompt_cache.py", "no_such_file.py"])
    assert "test_prompt_cache.py::TestPromptCache::test_save_load" in ids
    assert all(i.startswith("test_prompt_cache.py::") for i in ids)


@pytest.mark.slow
def test_runs_import_the_tree_they_are_given(sdist, tmp_path):
    """The plumbing: hub loads served by the stand-in, mlx_lm imported from
    the tree of the run, patches applied only when monkeypatched, the
    series' tests in place, outcomes recorded."""
    build_hub_standins(tmp_path)
    series = generate(all_patches(), sdist)
    tests = {rel: t for rel, t in series.final.items() if not is_source(rel)}
    pristine = tree_with(tmp_path / "pristine", {})
    patched = tree_with(tmp_path / "patched-tests", tests)
    files = ["test_prompt_cache.py"]
    extra = ["-k", "rotating or test_save_load"]
    base = run_tests(
        "unpatched", tmp_path, pristine / "tests", pristine, False, files, extra
    )
    mono = run_tests("mono", tmp_path, patched / "tests", patched, True, files, extra)
    assert base.applied == ""
    assert mono.applied == ",".join(p.name for p in mlx_lm_patched.PATCHES)
    for run in (base, mono):
        assert len(run.tests()) >= 4, run.log.read_text()[-2000:]
    worse, text = compare_runs(files, base, mono)
    assert worse == [], text
    # setUpClass loaded the stand-in through mlx_lm.utils.load.
    assert all(v["outcome"] == "passed" for v in mono.tests().values()), text


def test_the_unpatched_run_is_reused_only_for_the_same_selection():
    files = ["test_prompt_cache.py", "test_models.py"]
    key = _baseline_key(files, [])
    assert key == _baseline_key(list(files), [])
    assert key != _baseline_key(files[:1], [])
    assert key != _baseline_key(files, ["-k", "rotating"])


@pytest.mark.parametrize("worse", [[], ["t.py::T::test_x: passed -> failed"]])
def test_upstream_test_command_keeps_its_runs_only_when_one_is_worse(
    worse, tmp_path, monkeypatch, capsys
):
    """``python -m tools test`` leaves nothing in the temporary directory
    when no test does worse, and names the runs' directory when one does."""
    import tempfile
    from types import SimpleNamespace

    from tools import __main__ as cli

    sdist = tmp_path / "sdist"
    (sdist / "tests").mkdir(parents=True)
    (sdist / "tests" / "test_prompt_cache.py").write_text("")
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    monkeypatch.setattr(cli, "sdist_tree", lambda: sdist)
    monkeypatch.setattr(cli, "generate", lambda *a: SimpleNamespace(final={}))
    monkeypatch.setattr(cli, "tree_with", lambda dest, files: dest)

    def runs(work, *args):
        (work / "unpatched.log").write_text("a run's log")
        return worse, "the report"

    monkeypatch.setattr(cli, "against_unpatched", runs)
    assert cli.main(["test", "test_prompt_cache.py"]) == (1 if worse else 0)
    left = list(temp.iterdir())
    out = capsys.readouterr().out
    assert "the report" in out
    if worse:
        assert len(left) == 1 and (left[0] / "unpatched.log").exists()
        assert str(left[0]) in out
    else:
        assert left == []
