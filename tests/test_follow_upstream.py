"""Following upstream: a simulated next mlx-lm release (``tools.simulate``:
statements and comments added, docstrings reworded, locals renamed, imports
reordered in every replaced function, where our change does not touch them)
gets every patch merged onto it, with upstream's new statements running; a
real conflict sets aside only its patch and what needs that object."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import mlx_lm_patched
from mlx_lm_patched import _apply, _merge, _registry
from mlx_lm_patched.demo import tiny
from tools.simulate import changed_sources, simulated_release

MARK_TEXT = "_simulated.add('mlx_lm.generate:stream_generate')"

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.make_model_dir(tmp_path_factory.mktemp("model"))


def run_under(release, model_dir):
    """``follow_run.py`` with ``release`` first on the path; its JSON."""
    env = dict(os.environ, PYTHONPATH=f"{release.root}{os.pathsep}{ROOT}")
    env.pop("MLX_LM_PATCHED_APPLY", None)
    proc = subprocess.run(
        [sys.executable, str(HERE / "follow_run.py"), str(model_dir)],
        capture_output=True,
        text=True,
        env=env,
        cwd=release.root,
        timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[0][len("RESULT ") :])


@pytest.fixture(scope="module")
def pinned(model_dir, tmp_path_factory):
    """The same run on the pinned release, copied but not edited."""
    release = simulated_release(tmp_path_factory.mktemp("pinned"), [])
    return run_under(release, model_dir)


@pytest.fixture(scope="module")
def next_release(tmp_path_factory):
    return simulated_release(tmp_path_factory.mktemp("next"), mlx_lm_patched.PATCHES)


def test_the_simulated_release_edits_every_function_our_change_leaves_room_in(
    next_release,
):
    edits = next_release.edits
    # Every upstream object a patch replaces (with a delta) or edits.
    assert set(edits) == set(changed_sources(mlx_lm_patched.PATCHES))
    assert {
        t.name
        for p in mlx_lm_patched.PATCHES
        for t in p.targets
        if (_merge.bases().get(t.name) or {}).get("delta") is not None
        or isinstance(t.new, _registry.Edit)
    } == set(edits)
    added = [k for k, e in edits.items() if e.statement]
    assert len(added) >= 25
    # Where nothing was added, our change rewrites every line (or the
    # function is inherited): there is no place upstream could edit alone.
    for name, e in edits.items():
        assert e.statement or e.skipped, name
    assert any(e.renamed for e in edits.values())
    assert len(next_release.reordered) == 3


def test_every_patch_merges_onto_the_next_release_and_its_new_lines_run(
    next_release, model_dir, pinned
):
    result = run_under(next_release, model_dir)
    assert result["mlx_lm"].startswith(str(next_release.root))
    assert result["warnings"] == []
    assert result["applied"] == [p.name for p in mlx_lm_patched.PATCHES]
    edited = {k for k, e in next_release.edits.items() if e.statement}
    assert edited <= set(result["merged"])
    # Upstream's new statements ran, in the patched functions of the short
    # run: generate (bounded, quantized), batch_generate, cache files, the
    # prompt cache store, the server's parser.
    assert set(result["ran"]) >= {
        "mlx_lm.generate:stream_generate",
        "mlx_lm.generate:BatchGenerator.__init__",
        "mlx_lm.generate:maybe_quantize_kv_cache",
        "mlx_lm.models.cache:RotatingKVCache.__init__",
        "mlx_lm.models.cache:QuantizedKVCache.update_and_fetch",
        "mlx_lm.models.cache:BatchKVCache.merge",
        "mlx_lm.models.cache:KVCache.trim",
        "mlx_lm.models.cache:load_prompt_cache",
        "mlx_lm.models.cache:LRUPromptCache.insert_cache",
        "mlx_lm.models.cache:LRUPromptCache.fetch_nearest_cache",
        "mlx_lm.server:main",
    }
    assert set(result["ran"]) <= edited
    # The same tokens as the patches on the pinned release.
    for key in ("bounded", "unbounded", "quantized"):
        assert result[key] == pinned[key], key
    assert pinned["applied"] == result["applied"] and pinned["merged"] == []


RING = "mlx_lm.models.cache:RotatingKVCache.__init__"
STREAM = "mlx_lm.generate:stream_generate"
# What does not need the ring's or stream_generate's patched objects.
INDEPENDENT = {
    "bounded_attention",
    "negative_trim",
    "quantized_cache",
    "quantized_attention",
    "host_export",
    "generate_kv_checks",
    "max_kv_size",
    "kvcache_pipeline",
}


@pytest.fixture(scope="module")
def conflicting(tmp_path_factory):
    """The next release, with lines we change edited in two objects."""
    return simulated_release(
        tmp_path_factory.mktemp("conflict"),
        mlx_lm_patched.PATCHES,
        conflict=[RING, STREAM],
    )


def test_a_conflict_sets_aside_its_patch_and_what_needs_that_object_only(
    conflicting, model_dir
):
    assert conflicting.edits[RING].conflict and conflicting.edits[STREAM].conflict
    result = run_under(conflicting, model_dir)
    off = [p.name for p in mlx_lm_patched.PATCHES if p.name not in result["applied"]]
    assert "rotating_prealloc" in off and "speculative_bounded" in off
    assert INDEPENDENT <= set(result["applied"])
    # One warning per patch set aside; the conflicting one names the object
    # and its lines.
    assert len(result["warnings"]) == len(off)
    text = "\n".join(result["warnings"])
    assert "RotatingKVCache.__init__: base lines 1-2 changed by both" in text
    assert "upstream changed this line" in text
    # What stays applied still works: generation ran to the end.
    assert len(result["unbounded"]) == 12


def test_the_series_merges_onto_the_next_release_as_source(next_release, conflicting):
    """``check-release`` and ``vendor --version`` merge the same way."""
    from tools.release import merge_onto

    files, status = merge_onto(mlx_lm_patched.PATCHES, next_release.root)
    assert set(status.values()) == {"clean", "merged"}
    assert MARK_TEXT in files["mlx_lm/generate.py"]
    _, status = merge_onto(mlx_lm_patched.PATCHES, conflicting.root)
    assert status["rotating_prealloc"].startswith("conflict: ")
    assert "RotatingKVCache.__init__" in status["rotating_prealloc"]
    assert {n for n, how in status.items() if how in ("clean", "merged")} >= INDEPENDENT


def test_merge_keeps_both_sides_and_names_a_conflict():
    base = "def f(x):\n    a = 1\n    b = 2\n    c = 3\n    return a + b + c\n"
    ours = base.replace("b = 2", "b = 20")
    theirs = base.replace("    c = 3\n", "    c = 3\n    d = 4\n")
    merged = _merge.merge(base, ours, theirs, "f")
    assert "b = 20" in merged and "d = 4" in merged
    with pytest.raises(_merge.MergeConflict, match="f: base lines 3-3"):
        _merge.merge(base, ours, base.replace("b = 2", "b = 3"), "f")


def test_a_merged_function_shows_its_source_in_tracebacks():
    ns = {"__name__": "probe"}
    fn = _merge.compile_merged("def g():\n    raise KeyError(1)\n", ns, None, "g", "g")
    with pytest.raises(KeyError) as info:
        fn()
    assert "raise KeyError(1)" in "".join(info.traceback[-1].statement.lines)


def test_a_merged_method_using_super_is_bound_to_its_class():
    class Base:
        def m(self):
            return "base"

    class Owner(Base):
        pass

    src = "def m(self):\n    return 'merged ' + super().m()\n"
    Owner.m = _merge.compile_merged(src, {"__name__": "probe"}, Owner, "m", "m")
    assert Owner().m() == "merged base"


def test_bases_rebuild_the_pinned_source_of_every_replaced_object():
    """``bases.json`` is in step with the code (``python -m tools patches``)."""
    if _apply.installed_version() != _registry.UPSTREAM_VERSION:
        pytest.skip("bases.json is checked against the pinned release")
    from tools.bases import render

    assert _merge.BASES_FILE.read_text() == render(mlx_lm_patched.PATCHES)
