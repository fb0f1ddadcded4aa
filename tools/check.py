"""``check-patches``: is ``patches/`` what ``PATCHES`` generates, does it
apply with ``patch -p1 --fuzz=0`` to the pinned sdist, do the fingerprints
match its source, does the patched source define every name it reads, does
it import, and
does upstream's own test suite pass on the patched source (no worse than on
the pristine sdist; each test a patch adds passing with it and the
patches before it, failing without it)."""

import shutil
import tempfile
import textwrap
import types
from collections import defaultdict
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Set

from mlx_lm_patched import _merge
from mlx_lm_patched._registry import Patch

from . import PATCH_DIR, all_patches
from .bases import render as render_bases
from .release import check_targets
from .rewrite import (
    imported_from,
    is_edit,
    is_removal,
    patch_module,
    replacement_lines,
    split_owner,
)
from .sdist import fresh_tree, import_errors, module_file, sdist_tree
from .series import Series, apply_series, compare_patches, generate, is_source
from .source import free_names, module_names
from .suite import against_unpatched, run_tests, tree_with
from .testedits import added_tests


def check_uses(patches: Sequence[Patch], tree: Path) -> List[str]:
    """Each global name a patch's pasted code reads must be a builtin, a name
    a patch up to this one adds to that module, or a name the pinned
    upstream file binds."""
    problems: List[str] = []
    upstream: Dict[str, Set[str]] = {}
    added: Dict[str, Set[str]] = defaultdict(set)

    def bound(module: str) -> Set[str]:
        if module not in upstream:
            upstream[module] = module_names(
                (tree / module_file(module, tree)).read_text()
            )
        return upstream[module]

    for patch in patches:
        origin = getattr(patch_module(patch), "__file__", None)
        reads: Dict[str, Set[str]] = defaultdict(set)
        for t in patch.targets:
            module, cls = split_owner(t.owner)
            if cls is None and not is_removal(t):
                added[module].add(t.attr)
            if is_removal(t) or is_edit(t) or isinstance(t.new, types.ModuleType):
                continue  # an edit's names: the series' undefined names
            if imported_from(t):  # its code is checked where it is pasted
                continue
            reads[module] |= free_names(
                "".join(replacement_lines(t.new, t.attr, "", origin, cls))
            )
        who = f"patch {patch.name!r}"
        for module, names in sorted(reads.items()):
            unknown = sorted(names - added[module] - bound(module))
            if unknown:
                problems.append(
                    f"{who} reads {unknown}, which neither {module} defines nor "
                    "a patch up to this one adds"
                )
    return problems


def _first_import_error(series: Series, work: Path) -> List[str]:
    """Name the first patch after which the patched modules do not import."""
    fresh_tree(work)
    for name, files in series.steps:
        sources = {rel: text for rel, text in files.items() if is_source(rel)}
        for rel, text in sources.items():
            (work / rel).write_text(text)
        errors = import_errors(work, list(sources))
        if errors:
            return [f"after {name}, {e}" for e in errors]
    return ["the patched modules do not import"]


def added_tests_alone(
    series: Series, patches: Sequence[Patch], work: Path
) -> List[str]:
    """Each test a patch adds must fail on the source before that patch and
    pass on the source up to it: the patch's pull request stands on the
    earlier ones alone, and its tests test it."""
    problems = []
    before: Dict[str, str] = {}
    for patch, (name, after) in zip(patches, series.steps):
        ids = added_tests(patch)
        tests = {rel: t for rel, t in after.items() if not is_source(rel)}
        for when, step in (("without", before), ("with", after)):
            if not ids:
                break
            sources = {rel: t for rel, t in step.items() if is_source(rel)}
            label = f"{when}-{patch.name}"
            tree = tree_with(work / label, {**tests, **sources})
            run = run_tests(label, work, tree / "tests", tree, files=ids).tests()
            for i in ids:
                got = run.get(i, {"outcome": "not run", "reason": ""})
                if when == "without" and got["outcome"] in ("passed", "skipped"):
                    problems.append(
                        f"{i} ({name}) {got['outcome']} without the patch: "
                        "it does not test it"
                    )
                elif when == "with" and got["outcome"] != "passed":
                    problems.append(
                        f"{i} ({name}) {got['outcome']} on the source up to the "
                        f"patch: {got['reason']}"
                    )
        before = after
    return problems


def check_patches(
    patch_dir: Path = PATCH_DIR,
    patches: Optional[Sequence[Patch]] = None,
    suite: Optional[Sequence[str]] = None,
    log: Callable[[str], None] = print,
) -> List[str]:
    """Everything wrong with ``patch_dir``; empty when it is up to date. With
    ``suite`` (upstream test files), upstream's tests run on the patched
    source too, the report going to ``log``."""
    tree = sdist_tree()
    problems = []
    if patches is None:
        patches = all_patches()
        if _merge.BASES_FILE.read_text() != render_bases(patches):
            problems.append("bases.json: differs from the code (not in PATCHES)")
    series = generate(patches, tree, patch_dir)
    problems += compare_patches(series, patch_dir)
    problems += [
        f"{c.patch}: {c.where} {c.status} upstream ({c.detail or 'no fingerprint'}), "
        "so the monkeypatch would not apply as written"
        for c in check_targets(patches, tree, series)
        if c.status not in ("match", "new")
    ]
    problems += [f"undefined names: {w}" for w in series.warnings if "uses" in w]
    problems += check_uses(patches, tree)
    with tempfile.TemporaryDirectory(prefix="mlx-lm-check-") as d:
        work = fresh_tree(Path(d) / "tree")
        results = apply_series(work, patch_dir)
        problems += [
            f"{a.name} does not apply with `patch -p1 --fuzz=0` after the "
            f"patches before it:\n{textwrap.indent(a.output, '    ')}"
            for a in results
            if not a.ok
        ]
        if problems:
            return problems
        for rel, text in series.final.items():
            if (work / rel).read_text() != text:
                problems.append(f"the series applied gives a different {rel}")
        sources = [rel for rel in series.final if is_source(rel)]
        if import_errors(work, sources):
            problems += _first_import_error(series, Path(d) / "steps")
        if problems or suite is None:
            return problems
        runs = Path(tempfile.mkdtemp(prefix="mlx-lm-check-suite-"))
        worse, report = against_unpatched(runs, "patched-source", work, False, suite)
        log(report)
        problems += [f"upstream's suite on the patched source: {w}" for w in worse]
        problems += added_tests_alone(series, patches, runs)
        added = sum(len(added_tests(p)) for p in patches)
        log(f"each of the {added} tests the patches add: run without and with it")
        if problems:
            log(f"logs: {runs}")
        else:  # nothing to look into: leave nothing behind in /tmp
            shutil.rmtree(runs, ignore_errors=True)
    return problems
