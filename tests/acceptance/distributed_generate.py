"""One rank of the 2-rank acceptance run (``mlx.launch``), or the single
process it is compared with: greedy tokens of a tiny model per cache option,
written to ``OUT/rank<r>.json`` after each option (an error is written there
too, since ``mlx.launch`` exits 0 when a rank fails).

    python distributed_generate.py MODEL_DIR OUT tensor|pipeline
"""

import json
import sys
import traceback

import mlx.core as mx
from harness import LONG, MAX_TOKENS
from mlx_lm.generate import generate_step
from mlx_lm.utils import load, sharded_load

import mlx_lm_patched  # noqa: F401  (applies the patches)

OPTIONS = {
    "default": {},
    "max-kv-48": {"max_kv_size": 48},
    "kv8-start0": {"kv_bits": 8, "quantized_kv_start": 0},
}


def main(model_path, out, mode):
    group = mx.distributed.init()
    result = {"rank": group.rank(), "size": group.size(), "tokens": {}}

    def write():
        with open(f"{out}/rank{group.rank()}.json", "w") as f:
            json.dump(result, f)

    try:
        if group.size() == 1:
            model, tokenizer = load(model_path)
        elif mode == "tensor":
            model, tokenizer = sharded_load(model_path, tensor_group=group)
        else:
            model, tokenizer = sharded_load(model_path, pipeline_group=group)
        # What this rank holds: its attention heads and its layers.
        result["heads"] = model.layers[-1].self_attn.n_heads
        result["layers"] = len(model.layers)
        messages = [{"role": "user", "content": LONG}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        for name, options in OPTIONS.items():
            gen = generate_step(
                mx.array(prompt), model, max_tokens=MAX_TOKENS, **options
            )
            result["tokens"][name] = [t for t, _ in gen]
            write()
    except Exception:
        result["error"] = traceback.format_exc()
    write()
    if "error" not in result and group.size() > 1:
        # Exit together: a rank that exits while the other still reads its
        # last sends makes that read fail ("connection to a peer was lost").
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))


if __name__ == "__main__":
    main(*sys.argv[1:])
