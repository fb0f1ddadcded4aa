"""The patch generator (tools/): a patch's targets and tests written into
upstream's source as a diff, its DEP-3 header, and the check of the names
its pasted code takes from upstream. Runs on throwaway patches against the
pinned mlx-lm sdist (``.upstream/``); without the package index it skips.
"""

import logging
import subprocess
import sys
import types
import unittest
from pathlib import Path

import isort
import mlx.core as mx
import mlx_lm.models.cache as upstream_cache
import pytest
from mlx_lm.models.cache import _BaseCache

import mlx_lm_patched
from mlx_lm_patched import _apply, _newmods, _registry
from mlx_lm_patched._registry import REMOVED, Patch, Target, class_patch
from tools import rewrite, testedits
from tools.check import added_tests_alone, check_patches, check_uses
from tools.dep3 import bug_links, today
from tools.hub import build_hub_standins
from tools.release import check_targets
from tools.rewrite import GenerateError, reindent
from tools.sdist import fresh_tree
from tools.series import generate, read_series, write_patches
from tools.source import source_from_text

CACHE = "mlx_lm.models.cache"


def _patch(tree: Path, patch_dir: Path, name: str):
    cmd = ["patch", "-p1", "--batch", "--forward", "--fuzz=0", "-d", str(tree)]
    return subprocess.run(
        cmd + ["-i", str(patch_dir / name)], capture_output=True, text=True
    )


# -- the generator, on a throwaway patch ----------------------------------------


def _kv_size_times_one(cache) -> int:
    """A new module-level helper used by the throwaway patch."""
    return cache.offset * 1


class KVCache:
    def update_and_fetch(self, keys, values):
        # replaced: same behaviour, written differently
        out = self._grow_and_write(keys, values)
        return out

    def _grow_and_write(self, keys, values):
        prev = self.offset
        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            v_head_dim = values.shape[3]
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            k_shape = (B, n_kv_heads, n_steps * self.step, k_head_dim)
            v_shape = (B, n_kv_heads, n_steps * self.step, v_head_dim)
            new_k = mx.zeros(k_shape, keys.dtype)
            new_v = mx.zeros(v_shape, values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = mx.concatenate([self.keys, new_k], axis=2)
                self.values = mx.concatenate([self.values, new_v], axis=2)
            else:
                self.keys, self.values = new_k, new_v

        self.offset += keys.shape[2]
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]

    def size(self):
        return _kv_size_times_one(self)

    @property
    def state(self):
        """Replaced property: getter and setter."""
        return (self.keys, self.values, self.offset)

    @state.setter
    def state(self, v):
        keys, values, offset = v
        self.keys, self.values, self.offset = keys, values, offset

    def describe(self):
        """A new method, last in the namespace: goes after ``state``."""
        return f"KVCache(offset={self.offset})"


def _fp(attr: str) -> str:
    return _registry.fingerprint(_registry.get_original(f"{CACHE}:KVCache", attr))


def _throwaway() -> Patch:
    fps = {a: _fp(a) for a in ("update_and_fetch", "size", "state")}
    fps.update(_grow_and_write=None, describe=None)
    return Patch(
        "throwaway",
        # This project's own issue numbers stay out of the header.
        "KVCache: a rewrite that changes nothing (ml-explore/mlx-lm#1) (issue 4)",
        [Target(CACHE, "_kv_size_times_one", _kv_size_times_one, None)]
        + class_patch(
            f"{CACHE}:KVCache", KVCache, fps, removes={"nbytes": _fp("nbytes")}
        ),
    )


class QuantizedKVCache:
    def size(self):
        return self.offset


def _second() -> Patch:
    owner = f"{CACHE}:QuantizedKVCache"
    fp = _registry.fingerprint(_registry.get_original(owner, "size"))
    return Patch(
        "second",
        "QuantizedKVCache: own size",
        class_patch(owner, QuantizedKVCache, {"size": fp}),
    )


def _load_patched_cache(tree: Path):
    """Import ``tree``'s cache.py as a sibling of upstream's cache module."""
    import importlib.util

    name = "mlx_lm.models._upstream_test_cache"
    spec = importlib.util.spec_from_file_location(name, tree / "mlx_lm/models/cache.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


def test_generated_series_applies_and_runs_like_the_monkeypatch(sdist, tmp_path):
    patches = [_throwaway(), _second()]
    patch_dir = tmp_path / "patches"
    series = generate(patches, sdist, patch_dir)
    assert series.warnings == []
    write_patches(series, patch_dir)
    assert read_series(patch_dir) == ["01-throwaway.patch", "02-second.patch"]
    assert check_patches(patch_dir, patches) == []

    first = (patch_dir / "01-throwaway.patch").read_text()
    assert first.startswith(
        "Description: KVCache: a rewrite that changes nothing (ml-explore/mlx-lm#1)\n"
    )
    assert "Bug: https://github.com/ml-explore/mlx-lm/issues/1\n" in first
    assert "--- a/mlx_lm/models/cache.py\n+++ b/mlx_lm/models/cache.py\n" in first
    second = (patch_dir / "02-second.patch").read_text()
    assert "QuantizedKVCache" in second and "_grow_and_write" not in second

    tree = fresh_tree(tmp_path / "tree")
    for name in read_series(patch_dir):
        r = _patch(tree, patch_dir, name)
        assert r.returncode == 0, r.stdout + r.stderr
    text = (tree / "mlx_lm/models/cache.py").read_text()
    assert text == series.final["mlx_lm/models/cache.py"]

    # Placement: helper before KVCache (its first user), new method after the
    # replaced one before it in the namespace, property as one block, removal.
    kv = text.index("\nclass KVCache")
    assert text.index("\ndef _kv_size_times_one(cache)") < kv
    body = text[kv : text.index("\nclass ", kv + 1)]
    order = ["def update_and_fetch", "def _grow_and_write", "def size", "def state"]
    assert [body.index(x) for x in order] == sorted(body.index(x) for x in order)
    assert body.index("def state") < body.index("def describe")
    assert "def nbytes" not in body and "@state.setter" in body
    assert source_from_text(text, "KVCache", "state")[0] == (
        _registry.source_of(KVCache.__dict__["state"])
    )

    vendored = _load_patched_cache(tree)
    mlx_lm_patched.revert()
    try:
        _apply.apply_patches(patches, strict=True)
        for k in (1, 5, 300):
            a, b = vendored.KVCache(), upstream_cache.KVCache()
            x = mx.arange(2 * k * 4, dtype=mx.float32).reshape(1, 2, k, 4)
            for c in (a, b):
                c.update_and_fetch(x, x)
                c.update_and_fetch(x, x)
            assert a.size() == b.size() == 2 * k
            assert a.describe() == b.describe()
            assert all(mx.array_equal(p, q) for p, q in zip(a.state, b.state))
            assert "nbytes" not in vars(type(a)) and "nbytes" not in vars(type(b))
    finally:
        _apply.revert_patches(patches)
        mlx_lm_patched.apply()


_LIMIT = 1 << 20  # written as source, not as 1048576


def _log_size(cache):
    logging.getLogger(__name__).debug("%d tokens, limit %d", cache.offset, _LIMIT)


def test_imports_and_values_are_written_as_source(sdist, tmp_path):
    patch = Patch(
        "logs",
        "x",
        [
            Target(CACHE, "_LIMIT", _LIMIT, None),
            Target(CACHE, "_log_size", _log_size, None),
            Target(CACHE, "logging", logging, None),
        ],
    )
    series = generate([patch], sdist, tmp_path)
    assert series.warnings == []
    text = series.final["mlx_lm/models/cache.py"]
    assert text.startswith(
        "# Copyright © 2023 Apple Inc.\n\nimport copy\nimport logging\nfrom collections"
    )
    limit = text.index("_LIMIT = 1 << 20  # written as source, not as 1048576\n")
    assert limit < text.index("def _log_size(cache):")


def _twice(x):
    """A helper written for base.py, imported by cache.py and generate.py."""
    return x * 2


def test_a_function_pasted_into_another_module_is_imported_from_it(sdist, tmp_path):
    twice = _registry.pasted_into("mlx_lm.models.base", _twice)
    targets = [Target(m, "_twice", twice, None) for m in ("mlx_lm.models.base", CACHE)]
    targets.append(Target("mlx_lm.generate", "_twice_cached", twice, None))
    with pytest.raises(GenerateError, match="no 'from .models.base import'"):
        generate([Patch("helper", "x", targets)], sdist, tmp_path)
    twice_cached = _registry.pasted_into(CACHE, _twice)
    targets[-1] = Target("mlx_lm.generate", "_twice", twice_cached, None)
    series = generate([Patch("helper", "x", targets)], sdist, tmp_path)
    base, cache, gen = (
        series.final[f"mlx_lm/{name}.py"]
        for name in ("models/base", "models/cache", "generate")
    )
    assert base.count("def _twice(x):") == 1
    assert "def _twice" not in cache and "def _twice" not in gen
    assert "\nfrom .base import _twice, create_causal_mask\n" in cache
    imports = gen[gen.index("from .models.cache import (") :]
    imports = imports[: imports.index(")\n") + 2]
    assert imports.splitlines()[1:4] == [
        "    QuantizedKVCache,",
        "    TokenBuffer,",
        "    _twice,",
    ]
    for text in (cache, gen):  # as upstream's isort and black write it
        assert isort.code(text, profile="black") == text


class NewCache:
    def size(self):
        return 0


class _NewCacheSize:
    def size(self):
        return 1


def test_patch_on_a_class_an_earlier_patch_adds(sdist, tmp_path):
    first = Patch("adds", "x", [Target(CACHE, "NewCache", NewCache, None)])
    fp = _registry.fingerprint(NewCache.size)
    owner = f"{CACHE}:NewCache"
    second = Patch("on_it", "y", class_patch(owner, _NewCacheSize, {"size": fp}))
    checks = check_targets([first, second], sdist)
    assert [(c.status, c.where) for c in checks] == [
        ("new", f"{CACHE}.NewCache"),
        ("match", f"{CACHE}.NewCache.size (class added by an earlier patch)"),
    ]
    series = generate([first, second], sdist, tmp_path)
    text = series.final["mlx_lm/models/cache.py"]
    assert text.endswith("class NewCache:\n    def size(self):\n        return 1\n")


class Ring(upstream_cache.RotatingKVCache):
    def size(self):
        return 0


class _KVCacheToRing:
    def to_ring(self):
        return Ring(8)


def test_a_new_subclass_is_written_after_its_base_not_before_a_method_naming_it(
    sdist, tmp_path
):
    """``KVCache.to_ring`` names ``Ring`` in a method body, which runs later;
    ``Ring``'s base is read at import, so ``Ring`` must follow it."""
    ring = _registry.cache_class(CACHE, Ring, upstream_cache.RotatingKVCache)
    targets = [Target(CACHE, "Ring", ring, None)] + class_patch(
        f"{CACHE}:KVCache", _KVCacheToRing, {"to_ring": None}
    )
    series = generate([Patch("ring", "x", targets)], sdist, tmp_path)
    text = series.final["mlx_lm/models/cache.py"]
    base = text.index("class RotatingKVCache(_BaseCache):")
    assert text.index("def to_ring(self):") < base < text.index("class Ring(")


def test_regeneration_is_deterministic_and_keeps_last_update(sdist, tmp_path):
    patches = [_throwaway()]
    patch_dir = tmp_path / "patches"
    write_patches(generate(patches, sdist, patch_dir), patch_dir)
    path = patch_dir / "01-throwaway.patch"
    text = path.read_text().replace(
        f"Last-Update: {today()}", "Last-Update: 2000-01-01"
    )
    path.write_text(text)
    again = generate(patches, sdist, patch_dir)
    assert again.files["01-throwaway.patch"] == text
    assert write_patches(again, patch_dir) == []


def test_patch_removing_a_method_upstream_lacks_is_an_error(sdist):
    bogus = Patch("bogus", "x", [Target(f"{CACHE}:KVCache", "no_such", REMOVED, "0")])
    with pytest.raises(GenerateError, match="no_such"):
        generate([bogus], sdist, Path("/nonexistent"))


def test_undefined_helper_is_reported(sdist):
    def size(self):
        return _kv_size_times_one(self)

    size.__qualname__ = "KVCache.size"
    patch = Patch(
        "lonely", "x", [Target(f"{CACHE}:KVCache", "size", size, _fp("size"))]
    )
    series = generate([patch], sdist, Path("/nonexistent"))
    assert any("_kv_size_times_one" in w for w in series.warnings)


def test_patch_whose_source_does_not_import_is_named(sdist, tmp_path, monkeypatch):
    """A method annotated with a class defined later in cache.py imports
    under the monkeypatch but not as upstream source."""

    def empty(self):
        return self.keys is None

    source = "    def empty(self) -> BatchKVCache:\n        return self.keys is None\n"
    real = rewrite.replacement_lines
    monkeypatch.setattr(
        rewrite,
        "replacement_lines",
        lambda new, attr, indent, *rest: (
            source.splitlines(True) if new is empty else real(new, attr, indent, *rest)
        ),
    )
    owner = f"{CACHE}:KVCache"
    patch = Patch("late", "x", [Target(owner, "empty", empty, _fp("empty"))])
    patch_dir = tmp_path / "patches"
    write_patches(generate([patch], sdist, patch_dir), patch_dir)
    problems = check_patches(patch_dir, [patch])
    assert len(problems) == 1, problems
    assert problems[0].startswith("after 01-late.patch, ")
    assert "NameError: name 'BatchKVCache' is not defined" in problems[0]


def test_reindent_leaves_multiline_strings_alone():
    src = [
        "    def f(self):\n",
        '        """Doc\n',
        "text at column zero\n",
        '        """\n',
        "\n",
        "        return 1\n",
    ]
    out = reindent(src, "    ", "        ")
    assert out[2] == "text at column zero\n"
    assert out[0] == "        def f(self):\n" and out[5] == "            return 1\n"


# -- the names pasted code takes from upstream --------------------------------------


def _reads_upstream(self):
    return isinstance(self, (KVCache, _BaseCache)) and _kv_size_times_one(self) >= 0


_reads_upstream.__qualname__ = "KVCache.is_trimmable"


def _reading(name: str) -> Patch:
    """A patch whose code reads KVCache, _BaseCache and the throwaway
    patch's helper."""
    fp = _fp("is_trimmable")
    return Patch(
        name, "x", [Target(f"{CACHE}:KVCache", "is_trimmable", _reads_upstream, fp)]
    )


def test_names_read_from_upstream_or_an_earlier_patch_are_found(sdist):
    assert check_uses([_throwaway(), _reading("ok")], sdist) == []


def test_a_name_only_a_later_patch_adds_is_reported(sdist):
    problems = check_uses([_reading("early"), _throwaway()], sdist)
    assert problems == [
        "patch 'early' reads ['_kv_size_times_one'], which neither "
        "mlx_lm.models.cache defines nor a patch up to this one adds",
    ]


# -- a patch's upstream-style tests, written into upstream's test files -----------


class TestPromptCache:
    def test_throwaway_size_is_offset(self):
        cache = KVCache()
        self.assertEqual(cache.size(), 0)


class TestThrowaway(unittest.TestCase):
    def test_describe(self):
        self.assertIn("offset=0", KVCache().describe())


# Source for upstream's test file, not tests of this one.
TestPromptCache.__test__ = TestThrowaway.__test__ = False


def _with_tests(monkeypatch, patch: Patch, **tests) -> Patch:
    real = testedits.tests_of
    fake = types.SimpleNamespace(**tests)
    monkeypatch.setattr(
        testedits, "tests_of", lambda p: fake if p is patch else real(p)
    )
    return patch


def test_tests_go_into_upstreams_test_files(sdist, tmp_path, monkeypatch):
    rel = "tests/test_prompt_cache.py"
    old = "        self.assertEqual(cache.keys.shape, (1, 1, 3, 8))\n"
    new = "        self.assertEqual(cache.keys.shape, (1, 1, 4, 8))\n"
    patch = _with_tests(
        monkeypatch,
        _throwaway(),
        ADD={rel: [TestPromptCache, TestThrowaway]},
        EDIT={rel: [(old, new)]},
    )
    assert testedits.added_tests(patch) == [
        "test_prompt_cache.py::TestPromptCache::test_throwaway_size_is_offset",
        "test_prompt_cache.py::TestThrowaway::test_describe",
    ]
    series = generate([patch], sdist, tmp_path)
    assert series.warnings == []
    text = series.final[rel]
    upstream_text = (sdist / rel).read_text()
    assert text.count(new) == 1 and upstream_text.count(old) == 1
    # Appended to upstream's class, at its end; a new class before __main__.
    cls = text.index("\nclass TestPromptCache(")
    method = text.index("    def test_throwaway_size_is_offset(self):\n")
    assert cls < method < text.index("\nclass ", cls + 1)
    new_class = "\n\n\nclass TestThrowaway(unittest.TestCase):\n    def test_describe("
    assert new_class in text
    assert text.index("class TestThrowaway") < text.index('if __name__ == "__main__":')
    diff = series.files["01-throwaway.patch"]
    assert diff.index("+++ b/mlx_lm/models/cache.py") < diff.index(f"+++ b/{rel}")


def test_test_edit_that_does_not_match_once_is_an_error(sdist, monkeypatch):
    rel = "tests/test_prompt_cache.py"
    patch = _with_tests(monkeypatch, _throwaway(), EDIT={rel: [("self.", "me.")]})
    with pytest.raises(GenerateError, match="found [0-9]+ times, not once"):
        generate([patch], sdist, Path("/nonexistent"))


@pytest.mark.slow
def test_added_test_passing_without_its_patch_is_flagged(sdist, tmp_path, monkeypatch):
    """check-patches runs each patch's tests on the source before it (one
    that passes there does not test the patch) and up to it (they pass)."""
    rel = "tests/test_prompt_cache.py"
    patches = [
        _with_tests(
            monkeypatch, _throwaway(), ADD={rel: [TestPromptCache, TestThrowaway]}
        )
    ]
    series = generate(patches, sdist, tmp_path / "patches")
    build_hub_standins(tmp_path)
    assert added_tests_alone(series, patches, tmp_path) == [
        "test_prompt_cache.py::TestPromptCache::test_throwaway_size_is_offset "
        "(01-throwaway.patch) passed without the patch: it does not test it"
    ]


def test_bug_lines_cite_issues_not_pull_requests():
    doc = (
        "Upstream fails (ml-explore/mlx-lm#118, #126; PRs #941,\n #1322 and #1343\n"
        "closed unmerged; see https://github.com/ml-explore/mlx-lm/pull/7 and\n"
        "https://github.com/ml-explore/mlx-lm/issues/8, PR #9), #118 again."
    )
    assert bug_links(doc) == [
        "https://github.com/ml-explore/mlx-lm/issues/118",
        "https://github.com/ml-explore/mlx-lm/issues/126",
        "https://github.com/ml-explore/mlx-lm/issues/8",
    ]


def test_a_value_imported_from_a_module_beside_the_patch_is_written_as_there(
    tmp_path,
):
    """A patch's kernel source kept in a module beside it (``from .x import
    NAME``) is written as its assignment in that module, not as a repr."""
    (tmp_path / "sources.py").write_text('BIG = """\n  a kernel;\n"""\nOTHER = 1\n')
    patch = tmp_path / "patch.py"
    patch.write_text("from .sources import BIG\n\nSMALL = 2\n")
    lines = rewrite._assignment_lines("BIG", None, str(patch))
    assert "".join(lines) == 'BIG = """\n  a kernel;\n"""\n'
    assert rewrite._assignment_lines("OTHER", None, str(patch)) is None  # not imported
    assert rewrite._assignment_lines("SMALL", None, str(patch)) == ["SMALL = 2\n"]


def test_a_class_patch_s_attribute_is_written_as_its_expression(tmp_path):
    """A class attribute of a class patch (``class _Cache:`` for upstream's
    ``Cache``) is written as the expression in its body, not as the value it
    had where the series was generated."""
    patch = tmp_path / "patch.py"
    patch.write_text("class _Cache:\n    tail = 64 if on() else 0\n")
    lines = rewrite._assignment_lines("tail", "mlx_lm.models.cache.Cache", str(patch))
    assert lines == ["    tail = 64 if on() else 0\n"]


def test_a_new_module_is_a_new_file_and_upstreams_file_gets_its_import(sdist, tmp_path):
    """A patch's new modules are new files in its diff, as written; the
    upstream file gets only their import, placed as isort places it; the
    series applies with ``patch`` and the patched modules import (no
    import circle)."""
    from mlx_lm_patched.kernels import quantized_decode_kernel
    from tools.sdist import import_errors
    from tools.series import apply_series

    patch = quantized_decode_kernel.PATCH
    series = generate([patch], sdist, tmp_path)
    diff = series.files["01-quantized_decode_kernel.patch"]
    new = [t.new for t in patch.targets if isinstance(t.new, _newmods.NewModule)]
    for module in new:
        assert f"--- /dev/null\n+++ b/{module.file}\n" in diff
        assert series.final[module.file] == module.path.read_text()
    base = series.final["mlx_lm/models/base.py"]
    hook = "from ..kernels.quantized_decode import quantized_decode_attention, "
    assert f"\n\n{hook}use_decode_kernel\n" in base
    assert "def quantized_decode_attention" not in base
    assert isort.code(base, profile="black") == base
    write_patches(series, tmp_path)
    tree = fresh_tree(tmp_path / "tree")
    assert all(a.ok for a in apply_series(tree, tmp_path))
    assert import_errors(tree, ["mlx_lm/models/base.py", new[-1].file]) == []


# -- edits, stacked -----------------------------------------------------------------

_FIRST = """\
@@
 def maybe_trim_front(self):
+    self.edited = ["first"]
     # Maintain the cache below the chunk size.
"""
_SECOND = """\
@@
     self.edited = ["first"]
+    self.edited.append("second")
     # Maintain the cache below the chunk size.
"""


def test_stacked_edits_are_written_into_the_source_each_as_its_own_diff(
    sdist, tmp_path
):
    owner = f"{CACHE}:ChunkedKVCache"
    fp = _registry.fingerprint(_registry.get_original(owner, "maybe_trim_front"))
    patches = [
        Patch(name, "x", [Target(owner, "maybe_trim_front", _registry.Edit(d), fp)])
        for name, d in (("first", _FIRST), ("second", _SECOND))
    ]
    patch_dir = tmp_path / "patches"
    series = generate(patches, sdist, patch_dir)
    write_patches(series, patch_dir)
    assert check_patches(patch_dir, patches) == []
    second = (patch_dir / "02-second.patch").read_text()
    added = [ln for ln in second.splitlines() if ln.startswith("+") and "+++" not in ln]
    assert added == ['+        self.edited.append("second")']
    text = series.final["mlx_lm/models/cache.py"]
    assert '        self.edited = ["first"]\n        self.edited.append' in text
    with pytest.raises(GenerateError, match="hunk 1 .* no longer found"):
        generate(patches[1:], sdist, tmp_path / "alone")  # not on the first
