"""The verbatim count (``tools.verbatim``) and the edit writer
(``tools.edits``): what a patch carries of upstream, and diffs that
rebuild the source they change."""

import pytest

import mlx_lm_patched
from mlx_lm_patched import _merge, _registry
from tools.edits import diff_of
from tools.verbatim import carried, summary

OWNER = "mlx_lm.models.cache:ChunkedKVCache"


def _upstream_lines(attr):
    method = _registry.get_original(OWNER, attr)
    return _registry.source_of(method), _registry.fingerprint(method)


def _row(target):
    (row,) = carried([_registry.Patch("probe", "test only", [target])])
    return row


def test_a_copy_is_all_verbatim_and_an_edit_only_its_context():
    source, fp = _upstream_lines("maybe_trim_front")
    copy = _registry.get_original(OWNER, "maybe_trim_front")
    row = _row(_registry.Target(OWNER, "maybe_trim_front", copy, fp))
    assert row.verbatim == row.lines == len(source.splitlines())
    lines = source.splitlines(True)
    changed = "".join(lines[:3] + ["    pass\n"] + lines[3:])
    diff = diff_of(source, changed, context=2)
    edit = _registry.Edit(diff)
    row = _row(_registry.Target(OWNER, "maybe_trim_front", edit, fp))
    assert row.lines == len(lines) and row.verbatim == 4  # two lines either side


def test_diff_of_widens_a_hunk_until_its_lines_are_found_once():
    before = "def f():\n    a()\n    x = 1\n    b()\n    x = 1\n    c()\n"
    after = before.replace("    c()\n", "    x = 2\n    c()\n").replace(
        "    b()\n", "    b()\n    y = 0\n", 1
    )
    diff = diff_of(before, after, context=0)
    hunks = _registry.Edit(diff).hunks()
    assert len(hunks) == 2
    assert all(b and before.count("".join(b)) == 1 for b, _ in hunks)
    assert _merge.apply_hunks(before, hunks, "f") == after


def test_the_patches_carry_at_most_a_quarter_of_what_they_change_verbatim():
    rows = carried(mlx_lm_patched.PATCHES)
    lines = sum(r.lines for r in rows)
    assert sum(r.verbatim for r in rows) <= 0.25 * lines, summary(rows)


@pytest.mark.parametrize("context", [1, 3])
def test_diff_of_rebuilds_a_real_patched_function(context):
    name = "mlx_lm.server:ResponseGenerator._generate"
    key = next(k for k in _registry._installed if _merge.base_key(*k) == name)
    before = _registry.source_of(_registry.Target(*key, None, None).upstream())
    after = _registry.source_of(_registry._installed[key])
    diff = diff_of(before, after, context)
    assert _merge.apply_hunks(before, _registry.Edit(diff).hunks(), name) == after
