"""python -m mlx_lm_patched status: which patches are applied, and drift."""

import sys

import mlx_lm_patched


def status():
    rows = mlx_lm_patched.status()
    first = next(iter(rows.values()))
    print(
        f"mlx-lm-patched {mlx_lm_patched.__version__}: written for mlx-lm "
        f"{first['written_for']}, installed {first['installed']}"
    )
    width = max(map(len, rows))
    for name, s in rows.items():
        state = "applied" if s["applied"] else "not applied"
        if s["drift"]:
            state += "; drift: " + "; ".join(s["drift"])
        print(f"  {name:<{width}}  {state:<11}  {s['summary']}")
    applied = sum(s["applied"] for s in rows.values())
    print(f"{applied} of {len(rows)} patches applied")
    return 0 if applied == len(rows) else 1


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv != ["status"]:
        print("usage: python -m mlx_lm_patched status", file=sys.stderr)
        return 2
    return status()


if __name__ == "__main__":
    sys.exit(main())
