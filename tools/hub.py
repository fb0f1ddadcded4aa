"""Offline stand-ins for the Hugging Face models upstream's tests load: tiny
random-weight models in a Hugging Face cache of their own, so upstream's
``load`` finds them through the real offline hub lookup
(``HF_HUB_OFFLINE=1``)."""

import json
from pathlib import Path
from typing import Dict

# The hub model upstream's cache-related tests load, and its stand-in.
HUB_MODELS = {
    "mlx-community/Qwen1.5-0.5B-Chat-4bit": {
        "family": "llama",
        # Qwen1.5-0.5B's attention shape (16 heads of 64, no GQA), fewer heads.
        "config": {
            "model_type": "qwen2",
            "hidden_size": 256,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "head_dim": 64,
            "intermediate_size": 512,
        },
        "quantize": {"group_size": 64, "bits": 4},
        "dtype": "float16",
    },
}
# A made-up commit the stand-ins are filed under.
STANDIN_REVISION = "0" * 40


def hub_cache(work: Path) -> Path:
    return work / "hf-home" / "hub"


def build_hub_standins(work: Path) -> Dict[str, str]:
    """Tiny local models for every hub repo the upstream tests load, written
    into the Hugging Face cache under ``work`` (``hub_cache``)."""
    out = {}
    for repo, spec in HUB_MODELS.items():
        entry = hub_cache(work) / f"models--{repo.replace('/', '--')}"
        path = entry / "snapshots" / STANDIN_REVISION
        if not (path / "config.json").exists():
            _tiny_model_dir(path, **spec)
            (entry / "refs").mkdir(exist_ok=True)
            (entry / "refs" / "main").write_text(STANDIN_REVISION)
        out[repo] = str(path)
    return out


def _tiny_model_dir(path: Path, family, config, quantize, dtype) -> Path:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_lm_patched.demo import tiny

    config = tiny.model_config(family, **config)
    model = tiny.build_model(config, seed=0, dtype=dtype)
    if quantize:
        nn.quantize(model, **quantize)
        config["quantization"] = dict(quantize)
        config["quantization_config"] = dict(quantize)
    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
    index = {"metadata": {}, "weight_map": {k: "model.safetensors" for k in weights}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tiny.write_tokenizer(path)
    _swap_token_ids(path / "tokenizer.json", "!", "<|endoftext|>")
    return path


def _swap_token_ids(path: Path, a: str, b: str):
    """Give ``a`` the id of ``b`` and back: the Qwen vocabulary upstream's
    tests assume starts with ``!`` (id 0)."""
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    ids = {t["content"]: t for t in data["added_tokens"]}
    ia = ids[a]["id"] if a in ids else vocab[a]
    ib = ids[b]["id"] if b in ids else vocab[b]
    for token, new in ((a, ib), (b, ia)):
        if token in ids:
            ids[token]["id"] = new
        if token in vocab:
            vocab[token] = new
    path.write_text(json.dumps(data, ensure_ascii=False))
