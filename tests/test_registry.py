"""The patch registry: exact restore, idempotence, upstream drift.

Real patches are checked through ``mlx_lm_patched.PATCHES`` (whatever it holds).
Drift is checked with a test-only patch of a real mlx-lm class, so it does not
depend on which real patches exist.
"""

import dataclasses
import importlib
import inspect
import sys
import warnings

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ChunkedKVCache

import mlx_lm_patched
from mlx_lm_patched import (
    PatchDriftError,
    PatchDriftWarning,
    _apply,
    _merge,
    _newmods,
    _registry,
)
from mlx_lm_patched.caches import rotating_prealloc

OWNER = "mlx_lm.models.cache:ChunkedKVCache"
MISSING = object()


def raw(owner, attr):
    """The object stored for ``owner.attr`` (a class's own or inherited entry)."""
    if inspect.isclass(owner):
        for klass in owner.__mro__:
            if attr in klass.__dict__:
                return klass.__dict__[attr]
        return MISSING
    return getattr(owner, attr, MISSING)


def owner_of(t):
    """The target's owner, or MISSING where upstream lacks it (a class a patch adds)."""
    try:
        return t.resolve_owner()
    except AttributeError:
        return MISSING


def snapshot(patches):
    """Per target: the object seen, and whether the owner itself holds it."""
    out = {}
    for p in patches:
        for t in p.targets:
            owner = owner_of(t)
            if owner is MISSING:
                out[t.key] = (MISSING, False)
            else:
                out[t.key] = (raw(owner, t.attr), t.attr in vars(owner))
    return out


def all_targets(patches):
    return [t for p in patches for t in p.targets]


class Probe:
    """Test-only replacement, written like a patch of ``ChunkedKVCache``."""

    def maybe_trim_front(self):
        return "probe"

    def added_by_probe(self):
        return "probe"

    @classmethod
    def from_state(cls, state, meta_state):  # inherited from _BaseCache upstream
        return "probe"


def changed_maybe_trim_front(self):
    """Stands in for the method as a new mlx-lm release might write it."""
    return None


@pytest.fixture
def probe():
    """A test-only Patch of ChunkedKVCache; ChunkedKVCache is unchanged after."""
    keys = {t.key for t in all_targets(mlx_lm_patched.PATCHES)}
    if keys & {
        (OWNER, n) for n in ("maybe_trim_front", "added_by_probe", "from_state")
    }:
        pytest.skip("a real patch targets the probe's attributes")
    original = ChunkedKVCache.__dict__["maybe_trim_front"]
    prints = {
        "maybe_trim_front": _registry.fingerprint(original),
        "added_by_probe": None,
        "from_state": _registry.fingerprint(raw(ChunkedKVCache, "from_state")),
    }
    patch = _registry.Patch(
        "test_probe", "test only", _registry.class_patch(OWNER, Probe, prints)
    )
    yield patch
    _apply.revert_patches([patch])
    assert ChunkedKVCache.__dict__["maybe_trim_front"] is original
    assert "added_by_probe" not in ChunkedKVCache.__dict__
    assert "from_state" not in ChunkedKVCache.__dict__


@pytest.fixture(params=["changed", "removed", "added"])
def upstream_changed(request, probe, monkeypatch):
    """The probe's upstream as a new release might have it, listed in PATCHES."""
    if request.param == "changed":
        monkeypatch.setattr(
            ChunkedKVCache, "maybe_trim_front", changed_maybe_trim_front
        )
    elif request.param == "removed":
        monkeypatch.delattr(ChunkedKVCache, "maybe_trim_front")
    else:
        monkeypatch.setattr(
            ChunkedKVCache, "added_by_probe", changed_maybe_trim_front, raising=False
        )
    monkeypatch.setattr(mlx_lm_patched, "PATCHES", mlx_lm_patched.PATCHES + [probe])
    yield probe


def check_round_trip(patches, apply, revert):
    revert()
    original = snapshot(patches)
    for _ in range(2):
        apply()
        for t in all_targets(patches):
            owner = t.resolve_owner()
            if t.new is _registry.REMOVED:
                assert t.attr not in vars(owner)
            elif isinstance(t.new, _registry.Edit):  # the top one of its stack
                assert raw(owner, t.attr) is _registry._installed[t.key]
            else:  # a new module (and its hooks): the module its file made
                assert raw(owner, t.attr) is _newmods.materialize(t.attr, t.new)
            found = original[t.key][0]
            if found is not MISSING:
                assert _registry.get_original(t.owner, t.attr) is found
        for p in patches:
            assert _apply.is_applied(p.name)
        revert()
        assert snapshot(patches) == original
        for t in all_targets(patches):
            obj, owner = original[t.key][0], owner_of(t)
            assert obj is MISSING if owner is MISSING else raw(owner, t.attr) is obj
            if obj is not MISSING:
                assert _registry.get_original(t.owner, t.attr) is obj
        for p in patches:
            assert not _apply.is_applied(p.name)


def test_apply_revert_apply_restores_the_exact_upstream_objects():
    check_round_trip(
        mlx_lm_patched.PATCHES, mlx_lm_patched.apply, mlx_lm_patched.revert
    )


def test_probe_apply_revert_apply_restores_the_exact_upstream_objects(probe):
    check_round_trip(
        [probe],
        lambda: _apply.apply_patches([probe], strict=True),
        lambda: _apply.revert_patches([probe]),
    )
    assert not hasattr(ChunkedKVCache, "added_by_probe")


def test_get_original_is_the_same_object_patched_or_not(probe):
    stored = raw(ChunkedKVCache, "from_state")
    _apply.apply_patches([probe], strict=True)
    assert _registry.get_original(OWNER, "from_state") is stored
    _apply.revert_patches([probe])
    assert _registry.get_original(OWNER, "from_state") is stored


def test_module_target_rebinds_the_importers_and_restores_them():
    import mlx_lm.models.cache as cache_module

    generate_module = sys.modules["mlx_lm.generate"]  # the package rebinds the name
    taken = {t.key for t in all_targets(mlx_lm_patched.PATCHES)}
    names = ["can_trim_prompt_cache", "trim_prompt_cache", "make_prompt_cache"]
    names = [n for n in names if ("mlx_lm.models.cache", n) not in taken]
    if not names:
        pytest.skip("real patches target every candidate function")
    name = names[0]
    original = getattr(cache_module, name)
    assert getattr(generate_module, name) is original
    target = _registry.Target(
        "mlx_lm.models.cache",
        name,
        lambda *args, **kwargs: original(*args, **kwargs),
        _registry.fingerprint(original),
    )
    patch = _registry.Patch("test_module_probe", "test only", [target])
    try:
        _apply.apply_patches([patch], strict=True)
        assert getattr(cache_module, name) is target.new
        assert getattr(generate_module, name) is target.new
        assert _registry.get_original("mlx_lm.models.cache", name) is original
    finally:
        _apply.revert_patches([patch])
    assert getattr(cache_module, name) is original
    assert getattr(generate_module, name) is original


def test_applying_twice_changes_nothing():
    mlx_lm_patched.revert()
    upstream = snapshot(mlx_lm_patched.PATCHES)
    first = mlx_lm_patched.apply()
    patched = snapshot(mlx_lm_patched.PATCHES)
    saved = dict(_registry._saved)
    assert mlx_lm_patched.apply() == first
    assert snapshot(mlx_lm_patched.PATCHES) == patched
    assert _registry._saved == saved
    mlx_lm_patched.revert()
    assert snapshot(mlx_lm_patched.PATCHES) == upstream


def test_reverting_twice_changes_nothing():
    mlx_lm_patched.revert()
    upstream = snapshot(mlx_lm_patched.PATCHES)
    mlx_lm_patched.revert()
    assert snapshot(mlx_lm_patched.PATCHES) == upstream


def test_real_patches_match_the_installed_upstream():
    status = mlx_lm_patched.status()
    assert set(status) == {p.name for p in mlx_lm_patched.PATCHES}
    for name, s in status.items():
        assert s["drift"] == [], name
        assert s["written_for"] == _apply.installed_version() == s["installed"]
        assert s["applied"], name


def test_every_target_is_fingerprinted_against_its_upstream_source():
    for t in all_targets(mlx_lm_patched.PATCHES):
        if t.fingerprint is None:
            continue
        found = _registry.fingerprint(_registry.get_original(t.owner, t.attr))
        assert found == t.fingerprint, t.key


def test_drift_warns_and_leaves_upstream_unchanged(upstream_changed):
    before = snapshot([upstream_changed])
    with pytest.warns(PatchDriftWarning, match="test_probe"):
        applied = mlx_lm_patched.apply()
    assert "test_probe" not in applied
    assert not _apply.is_applied("test_probe")
    assert snapshot([upstream_changed]) == before


def test_drift_raises_with_strict_and_leaves_upstream_unchanged(upstream_changed):
    before = snapshot([upstream_changed])
    with pytest.raises(PatchDriftError, match="test_probe"):
        mlx_lm_patched.apply("test_probe", strict=True)
    assert not _apply.is_applied("test_probe")
    assert snapshot([upstream_changed]) == before


def test_drift_in_one_patch_does_not_stop_the_others(upstream_changed):
    mlx_lm_patched.revert()
    with pytest.warns(PatchDriftWarning):
        applied = mlx_lm_patched.apply()
    assert applied == [p.name for p in mlx_lm_patched.PATCHES if p.name != "test_probe"]


def test_status_reports_drift(upstream_changed):
    s = mlx_lm_patched.status()["test_probe"]
    assert not s["applied"]
    assert len(s["drift"]) == 1
    assert "ChunkedKVCache" in s["drift"][0]


def test_patch_whose_requirement_is_missing_is_not_applied(probe):
    needy = _registry.Patch("test_needy", "test only", probe.targets, ("absent",))
    before = snapshot([needy])
    with pytest.warns(PatchDriftWarning, match="absent"):
        assert "test_needy" not in _apply.apply_patches([needy])
    assert snapshot([needy]) == before
    assert not hasattr(ChunkedKVCache, "added_by_probe")


def test_patch_is_not_applied_when_its_requirement_drifted(upstream_changed):
    needy = _registry.Patch(
        "test_needy",
        "test only",
        [_registry.Target(OWNER, "needs_probe", lambda self: None, None)],
        ("test_probe",),
    )
    try:
        with pytest.warns(PatchDriftWarning):
            applied = _apply.apply_patches([upstream_changed, needy])
        assert "test_needy" not in applied
    finally:
        _apply.revert_patches([needy])


def test_class_patch_requires_a_fingerprint_for_every_attribute():
    with pytest.raises(ValueError, match="added_by_probe"):
        _registry.class_patch(OWNER, Probe, {"maybe_trim_front": None})


def test_two_patches_on_one_attribute_are_refused(probe):
    twin = _registry.Patch("test_twin", "test only", probe.targets[:1])
    with pytest.raises(ValueError, match="test_probe.*test_twin.*maybe_trim_front"):
        _apply.apply_patches([probe, twin])
    assert not _apply.is_applied("test_probe")
    assert not _apply.is_applied("test_twin")


def test_the_first_original_is_kept_when_a_target_is_set_again(probe):
    original = ChunkedKVCache.__dict__["maybe_trim_front"]
    target = next(t for t in probe.targets if t.attr == "maybe_trim_front")
    _apply.apply_patches([probe], strict=True)
    _registry.install(target, target.new)  # as a second patch of the same one would
    assert _registry.get_original(OWNER, "maybe_trim_front") is original
    _apply.revert_patches([probe])
    assert ChunkedKVCache.__dict__["maybe_trim_front"] is original


def test_reverting_a_patch_reverts_the_patches_that_need_it():
    from mlx_lm.models.cache import BatchRotatingKVCache

    mlx_lm_patched.apply()
    needs = _apply.dependents(["rotating_prealloc"])
    assert "batch_rotating_prealloc" in needs and "quantized_ring" in needs
    with pytest.warns(UserWarning, match="batch_rotating_prealloc"):
        reverted = mlx_lm_patched.revert("rotating_prealloc")
    assert set(reverted) == {"rotating_prealloc", *needs}
    status = mlx_lm_patched.status()
    assert not any(status[n]["applied"] for n in reverted)
    assert all(s["applied"] for n, s in status.items() if n not in reverted)
    # What is left still works: a batch ring is upstream's again, whole.
    cache = BatchRotatingKVCache(8, [1, 0])
    k = mx.zeros((2, 1, 3, 4))
    assert cache.update_and_fetch(k, k)[0].shape[2] == 3
    mlx_lm_patched.apply()
    assert all(s["applied"] for s in mlx_lm_patched.status().values())


class Renamed:
    """Test-only: reads a global the installed upstream does not bind."""

    def reads_renamed(self):
        return renamed_upstream  # noqa: F821


def test_a_name_upstream_lacks_keeps_the_patch_off(probe):
    reader = _registry.Patch(
        "test_reader",
        "test only",
        _registry.class_patch(OWNER, Renamed, {"reads_renamed": None}),
    )
    with pytest.warns(PatchDriftWarning, match=r"\['renamed_upstream'\]"):
        assert "test_reader" not in _apply.apply_patches([reader])
    assert "reads_renamed" not in ChunkedKVCache.__dict__


def drifted(patch):
    """``patch`` as if written against other upstream sources."""
    targets = [
        dataclasses.replace(t, fingerprint="000000000000")
        for t in patch.targets
        if t.fingerprint is not None
    ]
    return _registry.Patch("drifted_" + patch.name, patch.summary, targets)


def test_another_installed_version_with_unchanged_sources_still_applies(monkeypatch):
    """The version is only reported: fingerprints decide. An mlx-lm release
    whose patched objects are unchanged gets the patches, and ``status``
    shows both versions."""
    monkeypatch.setattr(_apply, "installed_version", lambda: "0.99.0")
    mlx_lm_patched.revert()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        applied = mlx_lm_patched.apply(strict=True)
    assert applied == [p.name for p in mlx_lm_patched.PATCHES]
    status = mlx_lm_patched.status()["rotating_prealloc"]
    assert (status["written_for"], status["installed"]) == ("0.32.2", "0.99.0")


def test_a_vendored_mlx_lm_gets_nothing_applied(monkeypatch):
    """``make vendor``'s wheel (``<release>+patched.N``) has the series in its
    source: applying onto it would find every patched object drifted and
    warn once a patch (the fronts apply at start)."""
    monkeypatch.setattr(_apply, "installed_version", lambda: "0.32.2+patched.30")
    mlx_lm_patched.revert()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mlx_lm_patched.apply() == []
    assert not any(_apply.is_applied(p.name) for p in mlx_lm_patched.PATCHES)
    # mlx_lm imported from a source tree: its metadata may name no version.
    monkeypatch.setattr(_apply, "installed_version", lambda: None)
    assert not _apply.vendored()


def test_another_installed_version_with_changed_sources_is_named_in_the_error(
    monkeypatch,
):
    monkeypatch.setattr(_apply, "installed_version", lambda: "0.99.0")
    mlx_lm_patched.revert()
    with pytest.raises(
        PatchDriftError, match="written for mlx-lm 0.32.2, installed 0.99.0"
    ):
        _apply.apply_patches([drifted(rotating_prealloc.PATCH)], strict=True)


class ReadsProbe:
    """Test-only: reads an attribute only the probe patch adds."""

    def reads_probe(self):
        return self.added_by_probe()


def test_an_attribute_only_another_patch_adds_is_a_need(probe):
    reader = _registry.Patch(
        "test_attr_reader",
        "test only",
        _registry.class_patch(OWNER, ReadsProbe, {"reads_probe": None}),
    )
    assert f"{OWNER}.added_by_probe" in _apply.requirements(reader)
    _apply.check_needs([probe, reader])
    with pytest.raises(ValueError, match="added_by_probe.*of later patches"):
        _apply.check_needs([reader, probe])
    # Alone it is set aside; reverting what it reads takes it along.
    with pytest.warns(PatchDriftWarning, match="added_by_probe, which is not"):
        assert _apply.apply_patches([reader]) == list(_apply._applied)
    assert "reads_probe" not in ChunkedKVCache.__dict__
    _apply.apply_patches([probe, reader])
    try:
        assert _apply.revert_patches([probe]) == ["test_probe", "test_attr_reader"]
    finally:
        _apply.revert_patches([reader])
    assert "reads_probe" not in ChunkedKVCache.__dict__


def test_attributes_off_the_bytecode_are_what_dis_says():
    """``_apply.attributes`` reads attribute loads and stores off
    ``co_code``; for every patched function it must equal ``dis``'s answer."""
    import dis
    import types

    def reference(code):
        reads, sets = set(), set()
        for i in dis.get_instructions(code):
            if i.opname in ("LOAD_ATTR", "LOAD_METHOD", "LOAD_SUPER_ATTR"):
                reads.add(i.argval)
            elif i.opname == "STORE_ATTR":
                sets.add(i.argval)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                more = reference(const)
                reads |= more[0]
                sets |= more[1]
        return reads, sets

    codes = [
        fn.__code__
        for p in mlx_lm_patched.PATCHES
        for t in p.targets
        for fn in _merge.functions(t.new)
    ]
    for code in codes:
        assert _apply.attributes(code) == reference(code), code.co_qualname


def test_no_patch_reads_what_a_later_patch_adds():
    """Every patch's needs, attributes included, come before it."""
    _apply.check_needs(mlx_lm_patched.PATCHES)


def test_global_reads_off_the_bytecode_are_what_dis_says():
    """``_merge._global_reads`` reads LOAD_GLOBAL/LOAD_NAME off ``co_code``;
    for every patched function it must equal ``dis``'s answer."""
    import dis
    import types

    def reference(code):
        names = {
            i.argval
            for i in dis.get_instructions(code)
            if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")
        }
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                names |= reference(const)
        return names

    codes = [
        fn.__code__
        for p in mlx_lm_patched.PATCHES
        for t in p.targets
        for fn in _merge.functions(t.new)
    ]
    assert len(codes) > 100
    for code in codes:
        assert _merge._global_reads(code) == reference(code), code.co_qualname


def test_a_new_module_is_installed_under_its_name_and_goes_on_revert():
    """A module upstream does not have is importable from mlx-lm while its
    patch is applied, the same module after a revert and an apply, and gone
    (neither in ``sys.modules`` nor an attribute of its package) reverted."""
    import mlx_lm.models
    from mlx_lm.models.prompt_cache_disk import DiskPromptCache

    module = sys.modules["mlx_lm.models.prompt_cache_disk"]
    assert mlx_lm.models.prompt_cache_disk is module
    with pytest.warns(UserWarning, match="also reverted"):
        mlx_lm_patched.revert("prompt_cache_disk_blocks")
    assert "mlx_lm.models.prompt_cache_disk" not in sys.modules
    assert not hasattr(mlx_lm.models, "prompt_cache_disk")
    with pytest.raises(ImportError):
        importlib.import_module("mlx_lm.models.prompt_cache_disk")
    mlx_lm_patched.apply()
    from mlx_lm.models.prompt_cache_disk import DiskPromptCache as again

    assert again is DiskPromptCache


def test_a_new_module_needs_what_it_imports_from_other_patches():
    """The names a new module imports that other patches add are its needs:
    reverting the patch of one reverts the new module's patch."""
    with pytest.warns(UserWarning, match="also reverted"):
        reverted = mlx_lm_patched.revert("host_export")
    assert "prompt_cache_disk" in reverted  # imports prompt_cache_state
    assert "mlx_lm.models.prompt_cache_disk" not in sys.modules


def test_a_module_upstream_now_has_is_a_conflict(tmp_path, monkeypatch):
    """Where upstream has a module of a new module's name, the patch is set
    aside rather than shadowing it."""
    import mlx_lm.models

    with pytest.warns(UserWarning, match="also reverted"):
        mlx_lm_patched.revert("prompt_cache_dir")
    (tmp_path / "prompt_cache_read.py").write_text("UPSTREAM = True\n")
    monkeypatch.setattr(
        mlx_lm.models, "__path__", [*mlx_lm.models.__path__, str(tmp_path)]
    )
    (target,) = [t for t in _patch("prompt_cache_dir").targets if "read" in t.attr]
    with pytest.raises(_merge.MergeConflict, match="now exists upstream"):
        target.resolve()
    with pytest.warns(PatchDriftWarning, match="prompt_cache_read now exists"):
        assert "prompt_cache_dir" not in mlx_lm_patched.apply("prompt_cache_dir")


def _patch(name):
    return next(p for p in mlx_lm_patched.PATCHES if p.name == name)


# -- edits: a diff of a function, stacked as quilt stacks patches ---------------

FIRST = """\
@@ -1,2 +1,3 @@
 def maybe_trim_front(self):
+    self.edited = ["first"]
     # Maintain the cache below the chunk size.
"""
# Written on top of FIRST: its context is FIRST's line.
SECOND = """\
@@ -2,2 +2,3 @@
     self.edited = ["first"]
+    self.edited.append("second")
     # Maintain the cache below the chunk size.
"""


@pytest.fixture
def stacked(probe):
    """Two test-only patches editing one upstream method, the second on the
    first's result; ChunkedKVCache is unchanged after."""
    original = ChunkedKVCache.__dict__["maybe_trim_front"]
    fp = _registry.fingerprint(original)
    first, second = (
        _registry.Patch(
            name,
            "test only",
            [_registry.Target(OWNER, "maybe_trim_front", _registry.Edit(diff), fp)],
        )
        for name, diff in (("test_first", FIRST), ("test_second", SECOND))
    )
    yield first, second
    _apply.revert_patches([first, second])
    assert ChunkedKVCache.__dict__["maybe_trim_front"] is original


def trimmed_front():
    c = ChunkedKVCache(chunk_size=4)
    c.maybe_trim_front()
    return getattr(c, "edited", None)


def test_an_edit_changes_upstream_s_source_and_shows_it_in_tracebacks(stacked):
    first, _ = stacked
    _apply.apply_patches([first], strict=True)
    assert trimmed_front() == ["first"]
    method = ChunkedKVCache.__dict__["maybe_trim_front"]
    assert method.__qualname__ == "ChunkedKVCache.maybe_trim_front"
    assert '    self.edited = ["first"]\n' in _registry.source_of(method)
    assert first.targets[0].drift() is None
    _apply.revert_patches([first])
    assert trimmed_front() is None


def test_stacked_edits_apply_in_order_and_popping_one_pops_those_on_it(stacked):
    first, second = stacked
    assert _apply.apply_patches([first, second], strict=True)[-2:] == [
        "test_first",
        "test_second",
    ]
    assert trimmed_front() == ["first", "second"]
    assert second.targets[0].drift() is None and first.targets[0].drift() is None
    assert _apply.revert_patches([second]) == ["test_second"]
    assert trimmed_front() == ["first"]
    _apply.apply_patches([second], strict=True)
    assert _apply.dependents(["test_first"]) == ["test_second"]
    assert set(_apply.revert_patches([first])) == {"test_first", "test_second"}
    assert trimmed_front() is None


def test_an_edit_whose_lines_upstream_changed_is_set_aside_with_what_stacks_on_it(
    stacked, monkeypatch
):
    first, second = stacked

    def maybe_trim_front(self):
        # Keep the cache below the chunk size (a new release's wording).
        return None

    monkeypatch.setattr(ChunkedKVCache, "maybe_trim_front", maybe_trim_front)
    with pytest.warns(PatchDriftWarning) as caught:
        _apply.apply_patches([first, second])
    text = "\n".join(str(w.message) for w in caught)
    assert (
        "ChunkedKVCache.maybe_trim_front: hunk 1" in text and "no longer found" in text
    )
    assert "as patch 'test_first' leaves it, which is not applied" in text
    assert not _apply.is_applied("test_first")
    assert not _apply.is_applied("test_second")
    assert ChunkedKVCache.__dict__["maybe_trim_front"] is maybe_trim_front


def test_an_edit_merges_onto_other_source_where_its_lines_are_unchanged(
    stacked, monkeypatch
):
    first, second = stacked
    src = _registry.source_of(ChunkedKVCache.__dict__["maybe_trim_front"])
    src = src.replace("        return\n", "        return 'new release'\n")
    new = _merge.compile_merged(src, {}, None, "maybe_trim_front", "next release")
    monkeypatch.setattr(ChunkedKVCache, "maybe_trim_front", new)
    _apply.apply_patches([first, second], strict=True)
    assert trimmed_front() == ["first", "second"]
    assert ChunkedKVCache(chunk_size=4).maybe_trim_front() == "new release"
    assert first.targets[0].drift().endswith("merged")
    _apply.revert_patches([first, second])  # before monkeypatch puts it back


def test_a_replacement_on_an_edited_attribute_is_refused(stacked, probe):
    first, _ = stacked
    with pytest.raises(ValueError, match="test_first.*test_probe.*maybe_trim_front"):
        _apply.check_disjoint([first, probe])
