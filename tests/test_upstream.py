"""The quilt series, the vendored wheel and release tracking (upstream.py).

Everything runs against the pinned mlx-lm sdist, downloaded once into
``.upstream/``; without the package index these tests skip.
"""

import inspect
import logging
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import mlx_lm.models.cache as upstream_cache
import pytest

import mlx_lm_patched
from mlx_lm_patched import _registry, upstream
from mlx_lm_patched._registry import REMOVED, Patch, Target, class_patch

CACHE = "mlx_lm.models.cache"


@pytest.fixture(scope="module")
def sdist():
    try:
        return upstream.sdist_tree()
    except upstream.UpstreamUnavailable as e:
        pytest.skip(f"package index unreachable, no mlx-lm sdist: {e}")


def _patch(tree: Path, patch_dir: Path, name: str, fuzz0=True):
    cmd = ["patch", "-p1", "--batch", "--forward", "-d", str(tree)]
    cmd += ["--fuzz=0"] if fuzz0 else []
    return subprocess.run(
        cmd + ["-i", str(patch_dir / name)], capture_output=True, text=True
    )


# -- the committed series -------------------------------------------------------


def test_check_patches_passes_on_committed_series(sdist):
    assert upstream.check_patches() == []


def test_check_patches_cli_is_fast_and_quiet(sdist):
    r = subprocess.run(
        [sys.executable, "-m", "mlx_lm_patched.upstream", "check-patches"],
        capture_output=True,
        text=True,
        timeout=120,  # 5-20 s; CI machines under load take longer
    )
    assert r.returncode == 0, r.stderr
    assert "check-patches: OK" in r.stdout


def test_series_lists_every_patch_in_order():
    names = upstream.read_series()
    assert names == [
        upstream.patch_name(i, p) for i, p in enumerate(mlx_lm_patched.PATCHES)
    ]
    for name in names:
        head = (upstream.PATCH_DIR / name).read_text().split("\n---\n")[0]
        for field in ("Description:", "Forwarded: no", "Upstream-Status: pending"):
            assert field in head, (name, field)
        assert "Last-Update: " in head


def _edited_copy(tmp_path: Path, edit) -> Path:
    patch_dir = tmp_path / "patches"
    shutil.copytree(upstream.PATCH_DIR, patch_dir)
    name = upstream.read_series(patch_dir)[0]
    path = patch_dir / name
    path.write_text(edit(path.read_text()))
    return patch_dir


def _first_added_line(text: str) -> str:
    body = text.split("\n---\n", 1)[1]
    return next(
        line for line in body.splitlines() if line.startswith("+") and line[1:].strip()
    )


def test_hand_edited_patch_is_detected(sdist, tmp_path):
    if not mlx_lm_patched.PATCHES:
        pytest.skip("PATCHES is empty")

    def edit(text):
        line = _first_added_line(text)
        return text.replace(line, line + "  # edited by hand", 1)

    problems = upstream.check_patches(_edited_copy(tmp_path, edit))
    assert any("differs from the regenerated patch" in p for p in problems)


def test_patch_that_no_longer_applies_is_detected(sdist, tmp_path):
    if not mlx_lm_patched.PATCHES:
        pytest.skip("PATCHES is empty")

    def edit(text):
        head, body = text.split("\n---\n", 1)
        removed = [x for x in body.splitlines() if x[:1] == "-" and x[:3] != "---"]
        line = next(x for x in removed if x[1:].strip())
        return head + "\n---\n" + body.replace(line, line + " # not upstream", 1)

    problems = upstream.check_patches(_edited_copy(tmp_path, edit))
    assert any("does not apply" in p for p in problems)


def test_stale_patch_file_is_detected(sdist, tmp_path):
    patch_dir = tmp_path / "patches"
    shutil.copytree(upstream.PATCH_DIR, patch_dir)
    (patch_dir / "99-gone.patch").write_text("Description: gone\n")
    assert any("99-gone.patch" in p for p in upstream.check_patches(patch_dir))


def test_check_release_of_pinned_version_matches(sdist):
    checks = upstream.check_targets(mlx_lm_patched.PATCHES, sdist)
    assert len(checks) == sum(len(p.targets) for p in mlx_lm_patched.PATCHES)
    assert [c for c in checks if not c.ok] == []
    r = subprocess.run(
        [sys.executable, "-m", "mlx_lm_patched.upstream", "check-release"]
        + [_registry.UPSTREAM_VERSION],
        capture_output=True,
        text=True,
    )
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
            src, _ = upstream.source_from_text(text, cls_name, attr)
            assert src is not None, (cls_name, attr)
            assert upstream.fingerprint_text(src) == expected, (cls_name, attr)
            compared += 1
        src, where = upstream.source_from_text(text, cls_name, "no_such_attr")
        assert (src, where) == (None, "absent")
    for name, obj in vars(upstream_cache).items():
        if inspect.isfunction(obj) and obj.__module__ == CACHE:
            src, _ = upstream.source_from_text(text, None, name)
            assert upstream.fingerprint_text(src) == _registry.fingerprint(obj)
            compared += 1
    assert compared > 100


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
        "KVCache: a rewrite that changes nothing (ml-explore/mlx-lm#1)",
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
    series = upstream.generate(patches, sdist, patch_dir)
    assert series.warnings == []
    upstream.write_patches(series, patch_dir)
    assert upstream.read_series(patch_dir) == ["01-throwaway.patch", "02-second.patch"]
    assert upstream.check_patches(patch_dir, patches) == []

    first = (patch_dir / "01-throwaway.patch").read_text()
    assert first.startswith(
        "Description: KVCache: a rewrite that changes nothing (ml-explore/mlx-lm#1)\n"
    )
    assert "Bug: https://github.com/ml-explore/mlx-lm/issues/1\n" in first
    assert "--- a/mlx_lm/models/cache.py\n+++ b/mlx_lm/models/cache.py\n" in first
    second = (patch_dir / "02-second.patch").read_text()
    assert "QuantizedKVCache" in second and "_grow_and_write" not in second

    tree = upstream.fresh_tree(tmp_path / "tree")
    for name in upstream.read_series(patch_dir):
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
    assert upstream.source_from_text(text, "KVCache", "state")[0] == (
        _registry.source_of(KVCache.__dict__["state"])
    )

    vendored = _load_patched_cache(tree)
    mlx_lm_patched.revert()
    try:
        _registry.apply_patches(patches, strict=True)
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
        _registry.revert_patches(patches)
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
    series = upstream.generate([patch], sdist, tmp_path)
    assert series.warnings == []
    text = series.final["mlx_lm/models/cache.py"]
    assert text.startswith(
        "# Copyright © 2023 Apple Inc.\n\nimport copy\nimport logging\nfrom collections"
    )
    limit = text.index("_LIMIT = 1 << 20  # written as source, not as 1048576\n")
    assert limit < text.index("def _log_size(cache):")


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
    checks = upstream.check_targets([first, second], sdist)
    assert [(c.status, c.where) for c in checks] == [
        ("new", f"{CACHE}.NewCache"),
        ("match", f"{CACHE}.NewCache.size (class added by an earlier patch)"),
    ]
    series = upstream.generate([first, second], sdist, tmp_path)
    text = series.final["mlx_lm/models/cache.py"]
    assert text.endswith("class NewCache:\n    def size(self):\n        return 1\n")


def test_regeneration_is_deterministic_and_keeps_last_update(sdist, tmp_path):
    patches = [_throwaway()]
    patch_dir = tmp_path / "patches"
    upstream.write_patches(upstream.generate(patches, sdist, patch_dir), patch_dir)
    path = patch_dir / "01-throwaway.patch"
    text = path.read_text().replace(
        f"Last-Update: {upstream._today()}", "Last-Update: 2000-01-01"
    )
    path.write_text(text)
    again = upstream.generate(patches, sdist, patch_dir)
    assert again.files["01-throwaway.patch"] == text
    assert upstream.write_patches(again, patch_dir) == []


def test_patch_removing_a_method_upstream_lacks_is_an_error(sdist):
    bogus = Patch("bogus", "x", [Target(f"{CACHE}:KVCache", "no_such", REMOVED, "0")])
    with pytest.raises(upstream.GenerateError, match="no_such"):
        upstream.generate([bogus], sdist, Path("/nonexistent"))


def test_undefined_helper_is_reported(sdist):
    def size(self):
        return _kv_size_times_one(self)

    size.__qualname__ = "KVCache.size"
    patch = Patch(
        "lonely", "x", [Target(f"{CACHE}:KVCache", "size", size, _fp("size"))]
    )
    series = upstream.generate([patch], sdist, Path("/nonexistent"))
    assert any("_kv_size_times_one" in w for w in series.warnings)


def test_patch_whose_source_does_not_import_is_named(sdist, tmp_path, monkeypatch):
    """A method annotated with a class defined later in cache.py imports
    under the monkeypatch but not as upstream source."""

    def empty(self):
        return self.keys is None

    source = "    def empty(self) -> BatchKVCache:\n        return self.keys is None\n"
    real = upstream.replacement_lines
    monkeypatch.setattr(
        upstream,
        "replacement_lines",
        lambda new, attr, indent, *rest: (
            source.splitlines(True) if new is empty else real(new, attr, indent, *rest)
        ),
    )
    owner = f"{CACHE}:KVCache"
    patch = Patch("late", "x", [Target(owner, "empty", empty, _fp("empty"))])
    patch_dir = tmp_path / "patches"
    upstream.write_patches(upstream.generate([patch], sdist, patch_dir), patch_dir)
    problems = upstream.check_patches(patch_dir, [patch])
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
    out = upstream._reindent(src, "    ", "        ")
    assert out[2] == "text at column zero\n"
    assert out[0] == "        def f(self):\n" and out[5] == "            return 1\n"


# -- upstream's own tests: the comparison ---------------------------------------


def _run(label, results):
    return upstream.Run(label, results, 1, Path("/dev/null"))


def test_compare_runs_flags_only_regressions():
    base = _run(
        "unpatched",
        {
            "t.py::a": {"outcome": "passed", "reason": ""},
            "t.py::b": {"outcome": "failed", "reason": "boom"},
            "t.py::c": {"outcome": "failed", "reason": "both"},
            "t.py::d": {"outcome": "skipped", "reason": "no metal"},
            "t.py::e": {"outcome": "passed", "reason": ""},
        },
    )
    patched = _run(
        "patched",
        {
            "t.py::a": {"outcome": "failed", "reason": "regressed"},
            "t.py::b": {"outcome": "passed", "reason": ""},
            "t.py::c": {"outcome": "error", "reason": "both"},
            "t.py::d": {"outcome": "skipped", "reason": "no metal"},
        },
    )
    worse, text = upstream.compare_runs(["t.py"], base, patched, accepted={})
    assert [w.split(":")[0] for w in worse] == ["t.py", "t.py"]
    assert "t.py::a" in worse[0] and "regressed" in worse[0]
    assert "t.py::e" in worse[1] and "not run patched" in worse[1]
    assert "failing in both runs: 1\n  t.py::c: both" in text
    assert "t.py    " in text and "1 passed   2 failed   1 skipped" in text

    worse, text = upstream.compare_runs(["t.py"], base, patched, {"t.py::a": "why"})
    assert len(worse) == 1 and "t.py::a: regressed (accepted: why)" in text


@pytest.mark.slow
def test_upstream_suite_runs_offline_and_patched(sdist, tmp_path):
    """The plumbing of ``upstream test``: hub loads served by the stand-in,
    patches applied only in the patched run, outcomes recorded."""
    shutil.copytree(sdist / "tests", tmp_path / "tests")
    models = upstream.build_hub_standins(tmp_path)
    files = ["test_prompt_cache.py"]
    extra = ["-k", "rotating or test_save_load"]
    runs = [
        upstream.run_upstream_tests(files, p, tmp_path, models, extra)
        for p in (False, True)
    ]
    assert runs[0].applied == ""
    assert runs[1].applied == ",".join(p.name for p in mlx_lm_patched.PATCHES)
    for run in runs:
        assert len(run.tests()) >= 4, run.log.read_text()[-2000:]
    worse, text = upstream.compare_runs(files, *runs)
    assert worse == [], text
    # setUpClass loaded the stand-in through mlx_lm.utils.load.
    outcomes = runs[1].tests().items()
    accepted = upstream.ACCEPTED_CHANGES
    assert all(v["outcome"] == "passed" for k, v in outcomes if k not in accepted), text


# -- the vendored wheel ---------------------------------------------------------


def _scenario(out_path: str, model_path: str, vendored_root, patches):
    """Fixed sequences of cache updates and a short generation, every output
    saved to ``out_path`` (.npz). Runs in a fresh interpreter, on the wheel
    installed at ``vendored_root`` or with ``patches`` applied (strictly)."""
    import os
    import sys
    import tempfile

    import mlx.core as mx
    import mlx_lm
    import numpy as np

    if vendored_root:
        assert mlx_lm.__file__.startswith(vendored_root), mlx_lm.__file__
        assert "+patched." in mlx_lm.__version__, mlx_lm.__version__
        assert "mlx_lm_patched" not in sys.modules
    else:
        import mlx_lm_patched

        applied = mlx_lm_patched.apply(*patches, strict=True) if patches else []
        assert applied == patches, applied

    from mlx_lm.generate import generate_step
    from mlx_lm.models import cache as C
    from mlx_lm.utils import load

    out = {}

    def rec(name, x):
        if isinstance(x, (tuple, list)):
            out[f"{name}:len"] = np.array(len(x))
            for i, y in enumerate(x):
                rec(f"{name}.{i}", y)
        elif x is None or isinstance(x, str):
            out[f"{name}:{x}"] = np.zeros(0)
        elif isinstance(x, mx.array):
            out[name] = np.array(x.astype(mx.float32) if x.dtype == mx.bfloat16 else x)
        else:
            out[name] = np.array(x)

    def outcome(name, f):
        try:
            rec(name, f())
        except Exception as e:  # the same error either way counts as the same
            rec(f"{name}:raised", type(e).__name__)

    caches = {
        "kv": (C.KVCache, {}),
        "rot8": (C.RotatingKVCache, {"max_size": 8}),
        "rot8keep2": (C.RotatingKVCache, {"max_size": 8, "keep": 2}),
        "rot300": (C.RotatingKVCache, {"max_size": 300}),
        "quant": (C.QuantizedKVCache, {"group_size": 32, "bits": 4}),
    }
    chunks = [5, 1, 1, 7, 1, 1, 1, 12, 1, 3, 1, 260, 1, 2]
    mx.random.seed(0)
    data = [mx.random.normal((1, 2, 2 * s, 32)) for s in chunks]
    d = tempfile.mkdtemp()
    for name, (cls, kw) in caches.items():
        c = cls(**kw)
        for i, x in enumerate(data):
            k, v = x[:, :, : chunks[i]], x[:, :, chunks[i] :]
            if hasattr(c, "make_mask") and cls is not C.QuantizedKVCache:
                outcome(f"{name}.{i}.mask", lambda: c.make_mask(k.shape[2]))
                if cls is C.RotatingKVCache:
                    outcome(
                        f"{name}.{i}.mask6",
                        lambda: c.make_mask(k.shape[2], window_size=6),
                    )
            outcome(f"{name}.{i}.fetch", lambda: c.update_and_fetch(k, v))
            rec(f"{name}.{i}.offset", c.offset)
            if i == 3:
                outcome(
                    f"{name}.{i}.trim", lambda: c.trim(2) if c.is_trimmable() else -1
                )
        outcome(f"{name}.state", lambda: c.state)
        outcome(f"{name}.meta", lambda: c.meta_state)
        path = os.path.join(d, f"{name}.safetensors")
        C.save_prompt_cache(path, [c])
        (loaded,) = C.load_prompt_cache(path)
        k, v = data[1][:, :, :1], data[1][:, :, 1:]
        outcome(f"{name}.loaded.fetch", lambda: loaded.update_and_fetch(k, v))

    batch = C.BatchRotatingKVCache(max_size=8, left_padding=[3, 0])
    mx.random.seed(1)
    for i, s in enumerate([6, 1, 1, 5, 1, 1, 1, 1, 1]):
        k, v = mx.random.normal((2, 2, s, 16)), mx.random.normal((2, 2, s, 16))
        outcome(f"batchrot.{i}.mask", lambda: batch.make_mask(s, return_array=True))
        outcome(f"batchrot.{i}.fetch", lambda: batch.update_and_fetch(k, v))

    for op, f in (
        ("filter", lambda: batch.filter(mx.array([1]))),
        ("extend", lambda: batch.extend(C.BatchRotatingKVCache(8, [1]))),
        ("fetch", lambda: batch.update_and_fetch(k[:2], v[:2])),
        ("extract", lambda: batch.extract(0).state),
        ("state", lambda: batch.state),
    ):
        outcome(f"batchrot.{op}", f)
    singles = []
    for n in (3, 9, 14):
        c = C.RotatingKVCache(max_size=8)
        c.update_and_fetch(*[mx.random.normal((1, 2, n, 16))] * 2)
        singles.append(c)
    outcome("batchrot.merged", lambda: C.BatchRotatingKVCache.merge(singles).state)

    model, tokenizer = load(model_path)
    prompt = mx.array(tokenizer.encode("The cache keeps what a transformer read. " * 6))
    for max_kv in (None, 16, 64):
        tokens, logprobs = [], []
        for tok, lp in generate_step(
            prompt, model, max_tokens=24, max_kv_size=max_kv, prefill_step_size=16
        ):
            tokens.append(tok)
            logprobs.append(lp)
        rec(f"gen.{max_kv}.tokens", tokens)
        rec(f"gen.{max_kv}.logprobs", mx.stack(logprobs))
    np.savez(out_path, **out)


def _run_scenario(tmp_path, label, model_path, pythonpath, vendored_root, patches):
    script = tmp_path / f"scenario_{label}.py"
    script.write_text(
        textwrap.dedent(inspect.getsource(_scenario))
        + f"\n_scenario({str(tmp_path / label)!r}, {model_path!r}, "
        + f"{vendored_root!r}, {patches!r})\n"
    )
    env = {**os.environ, "PYTHONPATH": pythonpath, "MLX_LM_PATCHED_APPLY": "0"}
    r = subprocess.run(
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert r.returncode == 0, f"{label}:\n{r.stdout}\n{r.stderr}"
    import numpy as np

    return dict(np.load(tmp_path / f"{label}.npz"))


def _differing(a: dict, b: dict) -> list:
    return sorted(
        k
        for k in set(a) | set(b)
        if k not in a
        or k not in b
        or a[k].shape != b[k].shape
        or not (a[k] == b[k]).all()
    )


def compare_vendored(tmp_path: Path, patch_dir: Path, patches: list):
    """Build the wheel from ``patch_dir``, run the scenario on it and on the
    installed mlx-lm with ``patches`` applied, and with none; return the keys
    that differ (vendored vs patched, patched vs upstream)."""
    from mlx_lm_patched import tiny

    try:
        wheel = upstream.build_wheel(tmp_path / "dist", patch_dir)
    except RuntimeError as e:
        if "No matching distribution" in str(e) or "connection" in str(e).lower():
            pytest.skip(f"package index unreachable, no build backend: {e}")
        raise
    assert wheel.name == f"mlx_lm-{upstream.vendor_version(patch_dir)}-py3-none-any.whl"
    site = tmp_path / "site"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index"]
        + ["--disable-pip-version-check", "--target", str(site), str(wheel)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    model = str(tiny.make_model_dir(tmp_path / "model", "llama_sliding"))
    root = str(upstream.ROOT)
    vendored = _run_scenario(tmp_path, "vendored", model, str(site), str(site), [])
    patched = _run_scenario(tmp_path, "patched", model, root, None, patches)
    plain = _run_scenario(tmp_path, "upstream", model, root, None, [])
    assert len(vendored) > 200 and any(".tokens" in k for k in vendored)
    return _differing(vendored, patched), _differing(patched, plain)


@pytest.mark.slow
def test_vendored_wheel_matches_monkeypatched_package(sdist, tmp_path):
    names = [p.name for p in mlx_lm_patched.PATCHES]
    assert upstream.read_series() == [
        upstream.patch_name(i, p) for i, p in enumerate(mlx_lm_patched.PATCHES)
    ], "patches/ is stale: run `make patches`"
    vendored_vs_patched, patched_vs_upstream = compare_vendored(
        tmp_path, upstream.PATCH_DIR, names
    )
    assert vendored_vs_patched == []
    # ...and the scenario does see the patches.
    assert patched_vs_upstream != []
