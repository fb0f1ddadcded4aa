"""``mlx_lm_patched/bases.json``: for every upstream object a patch replaces
or removes, the fingerprint of its source in the pinned release and the
lines where that source differs from ours, so the runtime can rebuild the
base and merge our change onto another release (``mlx_lm_patched._merge``).
An object changed by edits only has no delta: its edits are the change."""

import json
from typing import Dict, Sequence

from mlx_lm_patched import _apply, _merge, _registry
from mlx_lm_patched._registry import REMOVED, UPSTREAM_VERSION, Edit, Patch


def bases_of(patches: Sequence[Patch]) -> Dict[str, dict]:
    """``{Target.name: {"fingerprint", "delta"}}`` read off the installed
    mlx-lm, which must be the pinned release."""
    installed = _apply.installed_version()
    if installed != UPSTREAM_VERSION:
        raise RuntimeError(
            f"bases.json is written from mlx-lm {UPSTREAM_VERSION}; {installed} "
            "is installed"
        )
    out = {}
    for patch in patches:
        for t in patch.targets:
            original = t.upstream()
            if original is _registry._MISSING or t.name in out:  # edits stacked
                continue
            base = _registry.source_of(original)
            entry = {"fingerprint": _registry.fingerprint_source(base), "delta": None}
            if t.new is not REMOVED and not isinstance(t.new, Edit):
                ours = _registry.source_of(t.new).splitlines(True)
                entry["delta"] = _merge.delta(ours, base.splitlines(True))
            out[t.name] = entry
    return out


def render(patches: Sequence[Patch]) -> str:
    doc = {"written_for": UPSTREAM_VERSION, "objects": bases_of(patches)}
    return json.dumps(doc, indent=1, sort_keys=True) + "\n"


def write_bases(patches: Sequence[Patch]) -> bool:
    """Write ``bases.json``; whether it changed."""
    text = render(patches)
    path = _merge.BASES_FILE
    if path.exists() and path.read_text() == text:
        return False
    path.write_text(text)
    _merge.bases.cache_clear()
    return True
