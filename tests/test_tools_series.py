"""The committed quilt series (``patches/``) and release tracking (tools/).

Everything runs against the pinned mlx-lm sdist, downloaded once into
``.upstream/``; without the package index these tests skip.
"""

import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx_lm.models.cache as upstream_cache

import mlx_lm_patched
from mlx_lm_patched import _registry
from tools import PATCH_DIR, ROOT
from tools.check import check_patches
from tools.release import check_targets
from tools.series import patch_name, read_series
from tools.source import source_from_text

CACHE = "mlx_lm.models.cache"


def _tools(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "tools", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
    )


def test_check_patches_passes_on_committed_series(sdist):
    """All but upstream's suite, which ``make check-patches`` runs."""
    r = _tools("check-patches", "--no-suite", timeout=600)  # 1-2 min on CI
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("verbatim: ") and " of 2385 lines " in lines[0]
    assert lines[-1].startswith("check-patches: OK") and not r.stderr


def test_series_lists_every_patch_in_order_with_a_dep3_header():
    names = read_series()
    assert names == [patch_name(i, p) for i, p in enumerate(mlx_lm_patched.PATCHES)]
    for name in names:
        head = (PATCH_DIR / name).read_text().split("\n---\n")[0]
        fields = re.findall(r"(?m)^([A-Z][\w-]*):", head)
        assert fields[0] == "Description" and fields[-1] == "Last-Update", name
        assert set(fields) <= {"Description", "Origin", "Bug", "Forwarded"} | {
            "Last-Update"
        }, (name, fields)
        assert "Forwarded: no" in head and "Origin: " in head
        assert not re.search(r"\(issues? \d", head), name  # this project's tracker
        for bug in re.findall(r"(?m)^Bug: (.*)$", head):
            assert re.fullmatch(r"https://github.com/ml-explore/mlx-lm/issues/\d+", bug)


def _edited_copy(tmp_path: Path, edit) -> Path:
    patch_dir = tmp_path / "patches"
    shutil.copytree(PATCH_DIR, patch_dir)
    path = patch_dir / read_series(patch_dir)[0]
    path.write_text(edit(path.read_text()))
    return patch_dir


def test_hand_edited_patch_is_detected(sdist, tmp_path):
    def edit(text):
        body = text.split("\n---\n", 1)[1]
        line = next(x for x in body.splitlines() if x[:1] == "+" and x[1:].strip())
        return text.replace(line, line + "  # edited by hand", 1)

    problems = check_patches(_edited_copy(tmp_path, edit))
    assert any("differs from the regenerated patch" in p for p in problems)


def test_patch_that_no_longer_applies_is_detected(sdist, tmp_path):
    def edit(text):
        head, body = text.split("\n---\n", 1)
        removed = [x for x in body.splitlines() if x[:1] == "-" and x[:3] != "---"]
        line = next(x for x in removed if x[1:].strip())
        return head + "\n---\n" + body.replace(line, line + " # not upstream", 1)

    problems = check_patches(_edited_copy(tmp_path, edit))
    assert any("does not apply" in p for p in problems)


def test_stale_patch_file_is_detected(sdist, tmp_path):
    patch_dir = tmp_path / "patches"
    shutil.copytree(PATCH_DIR, patch_dir)
    (patch_dir / "99-gone.patch").write_text("Description: gone\n")
    assert any("99-gone.patch" in p for p in check_patches(patch_dir))


def test_check_release_of_pinned_version_matches(sdist):
    checks = check_targets(mlx_lm_patched.PATCHES, sdist)
    assert len(checks) == sum(len(p.targets) for p in mlx_lm_patched.PATCHES)
    assert [c for c in checks if not c.ok] == []
    r = _tools("check-release", _registry.UPSTREAM_VERSION)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"check-release {_registry.UPSTREAM_VERSION}: OK" in r.stdout


def test_text_fingerprints_equal_registry_fingerprints(sdist):
    """check-release reads fingerprints from source text; they must be the
    registry's, for every function, property and class of upstream's cache.py
    (including inherited attributes and ones that are absent)."""
    text = (sdist / "mlx_lm/models/cache.py").read_text()
    mlx_lm_patched.revert()  # conftest puts the patches back afterwards
    compared = 0
    for cls_name, cls in vars(upstream_cache).items():
        if not inspect.isclass(cls) or cls.__module__ != CACHE:
            continue
        names = {n for k in cls.__mro__ if k.__module__ == CACHE for n in vars(k)}
        for attr in sorted(names):
            owner = f"{CACHE}:{cls_name}"
            try:
                expected = _registry.fingerprint(_registry.get_original(owner, attr))
            except (TypeError, OSError, AttributeError):
                continue  # a plain value: the registry cannot fingerprint it either
            src, _ = source_from_text(text, cls_name, attr)
            assert src is not None, (cls_name, attr)
            assert _registry.fingerprint_source(src) == expected, (cls_name, attr)
            compared += 1
        assert source_from_text(text, cls_name, "no_such_attr") == (None, "absent")
    for name, obj in vars(upstream_cache).items():
        if inspect.isfunction(obj) and obj.__module__ == CACHE:
            src, _ = source_from_text(text, None, name)
            assert _registry.fingerprint_source(src) == _registry.fingerprint(obj)
            compared += 1
    assert compared > 100
