"""Tiny models built from mlx-lm's own model classes.

``make_model_dir`` writes a directory ``mlx_lm.load`` accepts: ``config.json``,
``model.safetensors`` and a byte-level BPE tokenizer (vocabulary 512, an eos
token and a ChatML-style chat template) trained here on a built-in text, so
nothing is downloaded. Weights depend only on the family, the overrides, the
seed and the dtype. ``tiny_model`` loads one for tests. The model ``make demo``
uses is ``tiny_train.demo_model_dir``: trained, not random, cached.
"""

import functools
import importlib
import json
import tempfile
from pathlib import Path
from typing import Optional, Union

import mlx.core as mx
from mlx.utils import tree_flatten

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Original text, only there to give the BPE trainer something to merge.
TEXT = """\
The key and value cache keeps what a transformer has already read, so that each
new token looks back at the whole context without computing it again. A cache
that grows one step at a time copies itself every time it runs out of room; a
cache that knows its final size can ask for that memory once and then write into
it in place. A sliding window keeps only the most recent tokens, wrapping around
a fixed buffer like the hands of a clock, while the first few tokens may be kept
forever as an anchor for attention.

On a small machine the difference shows up as memory that climbs and falls in a
saw tooth, and as pauses while large arrays are copied from one place to another.
On a large machine with many requests the same copies add up to gigabytes. The
tokens that come out must be the same either way: a faster cache that changes the
answer is not a faster cache, it is a different model.

Tests build tiny models with random weights. They are small enough to run a long
prompt on two processor cores in a few seconds, and they use the same classes,
the same attention masks and the same caches as the real models do. Nothing here
is trained to say anything useful; the words it produces are noise, but the noise
is repeatable, which is what a test needs.

Questions to ask of every patch: does it keep the same tokens, does it use less
memory, does it survive saving and loading a prompt cache, does it still work
when the batch changes size, and can it be taken back out again without leaving
a trace? If upstream changes the code a patch replaces, the patch should notice
and step aside rather than quietly run against code it was never written for.
"""

BASE_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB_SIZE,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    # Untied: random tied embeddings make greedy decoding repeat its input
    # token, which would hide cache bugs from token comparisons.
    "tie_word_embeddings": False,
}

FAMILIES = {
    "llama": {"model_type": "llama"},
    # llama with alternating sliding / full layers: make_cache mixes
    # RotatingKVCache(max_size=sliding_window) and KVCache.
    "llama_sliding": {"model_type": "llama", "sliding_window": 64},
    "qwen3": {"model_type": "qwen3"},
    # Layers i with (i + 1) % sliding_window_pattern != 0 slide.
    "gemma3_text": {
        "model_type": "gemma3_text",
        "sliding_window": 64,
        "sliding_window_pattern": 2,
        "query_pre_attn_scalar": 16,
        "rope_local_base_freq": 10000.0,
    },
    # The family whose model has both shard() and pipeline() (PipelineMixin).
    "qwen2": {"model_type": "qwen2"},
}

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def model_config(family: str = "llama", **overrides) -> dict:
    """The ``config.json`` of a tiny ``family`` model, ``overrides`` applied."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {list(FAMILIES)}")
    config = {**BASE_CONFIG, **FAMILIES[family], **overrides}
    if family == "llama_sliding" and "layer_types" not in overrides:
        config["layer_types"] = [
            "full_attention" if i % 2 else "sliding_attention"
            for i in range(config["num_hidden_layers"])
        ]
    return config


def bpe_tokenizer(texts, vocab_size: int):
    """A byte-level BPE ``tokenizers.Tokenizer`` of ``vocab_size`` trained on
    ``texts``, ``SPECIAL_TOKENS`` first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens")
    return tokenizer


@functools.lru_cache(maxsize=None)
def tokenizer_json() -> str:
    """A byte-level BPE tokenizer trained on ``TEXT``, as ``tokenizer.json``."""
    return bpe_tokenizer(TEXT.splitlines(), VOCAB_SIZE).to_str()


def write_tokenizer(path: Union[str, Path], tokenizer: Optional[str] = None) -> Path:
    """Write ``tokenizer`` (a ``tokenizer.json`` text, by default
    ``tokenizer_json()``) and its ``tokenizer_config.json`` to ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(tokenizer or tokenizer_json())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "pad_token": "<|endoftext|>",
        "bos_token": None,
        "unk_token": None,
        "chat_template": CHAT_TEMPLATE,
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": False,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return path


def build_model(config: dict, seed: int = 0, dtype: str = "float32"):
    """An mlx-lm ``Model`` for ``config``, weights drawn from ``seed`` (this
    reseeds MLX's global random generator)."""
    arch = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = arch.Model(arch.ModelArgs.from_dict(config))
    model.set_dtype(DTYPES[dtype])
    mx.eval(model.parameters())
    return model


def make_model_dir(
    path: Union[str, Path],
    family: str = "llama",
    seed: int = 0,
    dtype: str = "float32",
    **overrides,
) -> Path:
    """Write a tiny ``family`` model that ``mlx_lm.load(path)`` loads."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = model_config(family, **overrides)
    model = build_model(config, seed, dtype)
    weights = dict(tree_flatten(model.parameters()))
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    write_tokenizer(path)
    return path


def tiny_model(
    family: str = "llama", seed: int = 0, dtype: str = "float32", **overrides
):
    """``(model, tokenizer)`` of a tiny ``family`` model, through ``mlx_lm.load``."""
    from mlx_lm.utils import load

    with tempfile.TemporaryDirectory(prefix="mlx-lm-patched-tiny-") as d:
        return load(str(make_model_dir(d, family, seed, dtype, **overrides)))
