"""``python -m tools COMMAND``:

- ``patches``: write ``patches/`` (``series``) and ``bases.json``
  (``bases``) from ``PATCHES``.
- ``check-patches [--no-suite]``: fail if ``patches/`` is stale, does not
  apply, or does not pass upstream's suite as patched source (``check``).
- ``vendor [--out DIR] [--version V]``: build the patched mlx-lm wheel of
  the pinned release, or of release V with the patches merged (``vendor``).
- ``test [FILE ...] [-k EXPR]``: upstream's tests, unpatched vs
  monkeypatched (``mlx_lm_patched`` imported), the patched tests in both.
- ``check-release [VERSION]``: per patch, clean, merged or set aside on
  that release (``release``).
- ``edit OBJECT``: the diff, as an ``Edit`` takes it, between upstream's
  source of OBJECT (``mlx_lm.server:main``) and what the patches install.
"""

import argparse
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from mlx_lm_patched._registry import UPSTREAM_VERSION

from . import DIST_DIR, ROOT, all_patches
from .bases import write_bases
from .check import check_patches
from .edits import installed_diff
from .release import check_release
from .rewrite import GenerateError
from .sdist import UpstreamUnavailable, sdist_tree
from .series import compare_patches, generate, is_source, read_series, write_patches
from .suite import TEST_FILES, against_unpatched, default_files, tree_with
from .vendor import build_wheel
from .verbatim import carried, report


def cmd_patches(args) -> int:
    changed = ["bases.json"] if write_bases(all_patches()) else []
    series = generate(all_patches(), sdist_tree())
    changed += write_patches(series)
    for w in series.warnings:
        print(f"warning: {w}", file=sys.stderr)
    what = ", ".join(changed) if changed else "unchanged"
    n = len(series.files) - 1
    print(f"patches/: {n} patch(es) against mlx-lm {UPSTREAM_VERSION}: {what}")
    return 0


def cmd_check_patches(args) -> int:
    problems = check_patches(suite=None if args.no_suite else default_files())
    if problems:
        print("check-patches: FAILED", file=sys.stderr)
        for p in problems:
            print(f"- {p}", file=sys.stderr)
        if any(re.match(r"\S+: (missing|differs|not in PATCHES)", p) for p in problems):
            print("Run `make patches` and commit patches/.", file=sys.stderr)
        return 1
    print(report(carried(all_patches())))
    n = len(read_series())
    suite = "" if args.no_suite else "; upstream's suite passes on the patched source"
    print(
        f"check-patches: OK ({n} patch(es) up to date, apply to mlx-lm "
        f"{UPSTREAM_VERSION}{suite})"
    )
    return 0


def cmd_vendor(args) -> int:
    if compare_patches(generate(all_patches(), sdist_tree())):
        print(
            "warning: patches/ is not up to date (run `make patches`)", file=sys.stderr
        )
    try:
        wheel, status = build_wheel(Path(args.out), release=args.version)
    except RuntimeError as e:
        print(f"vendor: FAILED: {e}", file=sys.stderr)
        return 1
    for name, how in status.items():
        print(f"  {name}: {how}")
    print(f"vendor: {wheel.relative_to(ROOT) if wheel.is_relative_to(ROOT) else wheel}")
    return 0


def cmd_test(args) -> int:
    files = args.files or default_files()
    tree = sdist_tree()
    for f in files:
        if not (tree / "tests" / f.split("::")[0]).exists():
            print(f"test: no tests/{f} in the mlx-lm {UPSTREAM_VERSION} sdist")
            return 2
    series = generate(all_patches(), tree)
    work = Path(tempfile.mkdtemp(prefix="mlx-lm-upstream-tests-"))
    worse = True
    try:
        tests = {rel: t for rel, t in series.final.items() if not is_source(rel)}
        patched_tests = tree_with(work / "patched-tests", tests)
        extra = ["-k", args.k] if args.k else []
        worse, report = against_unpatched(
            work, "monkeypatched", patched_tests, True, files, extra
        )
        print(report)
    finally:
        if worse:
            print(f"logs (each run's): {work}")
        else:  # nothing to look into: leave nothing behind in /tmp
            shutil.rmtree(work, ignore_errors=True)
    return 1 if worse else 0


def cmd_edit(args) -> int:
    print(installed_diff(args.object), end="")
    return 0


def cmd_check_release(args) -> int:
    ok, report = check_release(all_patches(), args.version)
    print(report)
    return 0 if ok else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("patches", help="write patches/ from PATCHES")
    p = sub.add_parser(
        "check-patches", help="patches/ up to date, applying, passing upstream's suite"
    )
    p.add_argument("--no-suite", action="store_true", help="skip upstream's suite")
    p = sub.add_parser("vendor", help="build the patched mlx-lm wheel into dist/")
    p.add_argument("--out", default=str(DIST_DIR))
    p.add_argument(
        "--version",
        default="",
        help=f"the mlx-lm release to patch (default: {UPSTREAM_VERSION}; "
        "'latest': the newest)",
    )
    p = sub.add_parser("test", help="upstream's tests, unpatched vs monkeypatched")
    p.add_argument("files", nargs="*", help=f"default: {' '.join(TEST_FILES)}")
    p.add_argument("-k", help="pytest -k expression")
    p = sub.add_parser("check-release", help="do the patches fit an mlx-lm release")
    p.add_argument("version", nargs="?", default="latest", help="default: latest")
    p = sub.add_parser("edit", help="an upstream object's change, as an Edit's diff")
    p.add_argument("object", help="e.g. mlx_lm.server:ResponseGenerator._generate")
    args = parser.parse_args(argv)
    handler = {
        "patches": cmd_patches,
        "check-patches": cmd_check_patches,
        "vendor": cmd_vendor,
        "test": cmd_test,
        "check-release": cmd_check_release,
        "edit": cmd_edit,
    }[args.command]
    try:
        return handler(args)
    except (UpstreamUnavailable, GenerateError) as e:
        print(f"{args.command}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
