"""python -m mlx_lm_patched status | demo-model.

``status``: which patches are applied, by folder, and drift. ``demo-model``: the path of
the demo model (``tiny_train.demo_model_dir``), trained on first use: a model that
needs no download, for the README's quick start."""

import sys

import mlx_lm_patched

USAGE = """usage: python -m mlx_lm_patched {status,demo-model}
  status      which patches are applied, and whether the installed mlx-lm
              still has the source each was written for
  demo-model  print the demo model's directory, training it first if needed
              (once, about 2 CPU-minutes; kept in ~/.cache/mlx_lm_patched or
              $MLX_LM_PATCHED_HOME)"""


def status():
    rows = mlx_lm_patched.status()
    first = next(iter(rows.values()))
    print(
        f"mlx-lm-patched {mlx_lm_patched.__version__}: written for mlx-lm "
        f"{first['written_for']}, installed {first['installed']}"
    )
    width = max(map(len, rows))
    for folder in dict.fromkeys(s["folder"] for s in rows.values()):
        print(f"{folder}/")
        for name, s in rows.items():
            if s["folder"] != folder:
                continue
            state = "applied" if s["applied"] else "not applied"
            if s["drift"]:
                state += "; drift: " + "; ".join(s["drift"])
            print(f"  {name:<{width}}  {state:<11}  {s['summary']}")
    applied = sum(s["applied"] for s in rows.values())
    print(f"{applied} of {len(rows)} patches applied")
    return 0 if applied == len(rows) else 1


def demo_model():
    """Only the path goes to stdout (training reports on stderr), so that
    ``MODEL=$(python -m mlx_lm_patched demo-model)`` works."""
    from mlx_lm_patched.demo import tiny_train

    print(tiny_train.demo_model_dir())
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    commands = {"status": status, "demo-model": demo_model}
    if argv in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    if len(argv) != 1 or argv[0] not in commands:
        print(USAGE, file=sys.stderr)
        return 2
    return commands[argv[0]]()


if __name__ == "__main__":
    sys.exit(main())
