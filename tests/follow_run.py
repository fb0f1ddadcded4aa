"""Run under a simulated mlx-lm release (``tools.simulate``; its root first
on ``PYTHONPATH``): import the patches, drive generate, batch_generate,
prompt-cache files, the prompt cache store and the server's argument parser
on a tiny model, and print JSON: which patches applied, which objects were
merged, which of upstream's new statements ran, and the tokens.

``python follow_run.py MODEL_DIR``
"""

import json
import sys
import tempfile
import warnings

import mlx.core as mx

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import mlx_lm_patched

import mlx_lm
from mlx_lm import batch_generate, load, server, stream_generate
from mlx_lm.models import cache
from mlx_lm.sample_utils import make_sampler

from mlx_lm_patched import _apply

model, tokenizer = load(sys.argv[1])
prompt = list(range(5, 70))
greedy = make_sampler(0.0)


def tokens(**kw):
    out = stream_generate(model, tokenizer, prompt, max_tokens=12, sampler=greedy, **kw)
    return [r.token for r in out]


ring = cache.make_prompt_cache(model, max_kv_size=32)
result = {"bounded": tokens(prompt_cache=ring), "unbounded": tokens()}
result["quantized"] = tokens(kv_bits=8, quantized_kv_start=0)
batch = batch_generate(model, tokenizer, [prompt, prompt[:40]], max_tokens=6)
result["batch"] = len(batch.texts)
with tempfile.TemporaryDirectory() as d:
    cache.save_prompt_cache(f"{d}/c.safetensors", ring)
    loaded = cache.load_prompt_cache(f"{d}/c.safetensors")
    result["loaded"] = loaded[0].offset == ring[0].offset
full = cache.make_prompt_cache(model)
out = tokens(prompt_cache=full)
cache.trim_prompt_cache(full, 2)
store = cache.LRUPromptCache(max_size=2)
store.insert_cache("m", (prompt + out)[: full[0].offset], full)
store.fetch_nearest_cache("m", prompt + [1])
store.trim_to(n_sequences=1)
try:
    sys.argv = ["mlx_lm.server", "--help"]
    server.main()
except SystemExit:
    pass
mx.eval(mx.zeros(1))
result.update(
    applied=[p.name for p in mlx_lm_patched.PATCHES if _apply.is_applied(p.name)],
    merged=sorted(n for names in _apply._merged.values() for n in names),
    ran=sorted(mlx_lm._simulated),
    warnings=[str(w.message) for w in caught],
    mlx_lm=mlx_lm.__file__,
)
print("RESULT " + json.dumps(result))
