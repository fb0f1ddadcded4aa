"""Train the demo model: a small llama on the Python standard library's sources.

MLX's CPU backend on Linux multiplies through a reference BLAS (about 1
GFLOP/s on two cores), so training runs in numpy (its BLAS is ~20x faster
there) with a hand-written backward pass of mlx-lm's llama, checked against
``mx.grad`` in the tests. The weights are then saved for ``mlx_lm.load``.
Everything is seeded: the same standard library gives the same model.
"""

import argparse
import hashlib
import inspect
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Optional, Union

import numpy as np

from mlx_lm_patched.demo import tiny

# What the model is (llama with sliding and full layers) and how it is trained.
CONFIG = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "rms_norm_eps": 1e-5,
    "vocab_size": 2048,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "sliding_window": 64,
    "layer_types": ["sliding_attention", "full_attention"],
}
# 660 steps of 8 windows (a step about 0.19 s on one core): about 130
# CPU-seconds in all. Batches of 4 for the same time learn less (held-out
# loss 1% higher).
RECIPE = {
    "steps": 660,
    "batch": 8,
    "length": 256,
    "lr": 5e-3,
    "lr_end": 0.0,
    "seed": 0,
}
HELD_OUT = 10  # every 10th standard library module is kept out of training


def corpus_files(held_out: bool = False):
    """The standard library's top-level modules, sorted; every ``HELD_OUT``-th
    one is held out for evaluation."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return [f for i, f in enumerate(files) if (i % HELD_OUT == 0) == held_out]


def corpus(held_out: bool = False):
    return [f.read_text(errors="replace") for f in corpus_files(held_out)]


def init_params(config, rng):
    h, v, i = config["hidden_size"], config["vocab_size"], config["intermediate_size"]
    d = config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d

    def lin(n, m):
        return (rng.standard_normal((n, m)) * m**-0.5).astype(np.float32)

    params = {
        "model.embed_tokens.weight": lin(v, h) * h**0.5 * 0.02,
        "model.norm.weight": np.ones(h, np.float32),
        "lm_head.weight": lin(v, h),
    }
    for n in range(config["num_hidden_layers"]):
        p = f"model.layers.{n}."
        params[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        params[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        params[p + "self_attn.q_proj.weight"] = lin(q, h)
        params[p + "self_attn.k_proj.weight"] = lin(kv, h)
        params[p + "self_attn.v_proj.weight"] = lin(kv, h)
        params[p + "self_attn.o_proj.weight"] = lin(h, q) * 0.5
        params[p + "mlp.gate_proj.weight"] = lin(i, h)
        params[p + "mlp.up_proj.weight"] = lin(i, h)
        params[p + "mlp.down_proj.weight"] = lin(h, i) * 0.5
    return params


def _norm(x, w, eps):
    r = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return x * r * w, r


def _norm_back(dy, x, w, r):
    g = dy * w
    dx = r * g - x * r**3 * (g * x).mean(-1, keepdims=True)
    return dx, (dy * x * r).reshape(-1, x.shape[-1]).sum(0)


def _rope(x, cos, sin, sign=1):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - sign * x2 * sin, sign * x1 * sin + x2 * cos], -1)


def loss_and_grads(params, config, inputs, targets):
    """Mean cross-entropy of ``targets`` after ``inputs`` (batch, length), and
    its gradient for every parameter: mlx-lm's llama, forward and back."""
    b, t = inputs.shape
    h, eps = config["hidden_size"], config["rms_norm_eps"]
    nh, nkv, d = (
        config[k] for k in ("num_attention_heads", "num_key_value_heads", "head_dim")
    )
    group = nh // nkv
    freqs = config["rope_theta"] ** (-np.arange(0, d // 2) / (d // 2))
    theta = np.arange(t)[:, None] * freqs
    cos, sin = np.cos(theta).astype(np.float32), np.sin(theta).astype(np.float32)
    i, j = np.arange(t)[:, None], np.arange(t)[None]
    causal = j <= i
    masks = {
        "full_attention": causal,
        "sliding_attention": causal & (i - j < config["sliding_window"]),
    }
    # The query heads sharing a key-value head are one matrix of group * t
    # rows: larger products, and no copies of the keys and values.
    masks = {
        kind: np.tile(np.where(m, 0, -np.inf).astype(np.float32), (group, 1))
        for kind, m in masks.items()
    }
    scale = d**-0.5

    x = params["model.embed_tokens.weight"][inputs]
    saved = []
    for n, kind in enumerate(config["layer_types"]):
        p = f"model.layers.{n}."
        a, ra = _norm(x, params[p + "input_layernorm.weight"], eps)
        q = (a @ params[p + "self_attn.q_proj.weight"].T).reshape(b, t, nh, d)
        k = (a @ params[p + "self_attn.k_proj.weight"].T).reshape(b, t, nkv, d)
        v = (a @ params[p + "self_attn.v_proj.weight"].T).reshape(b, t, nkv, d)
        q = _rope(q.transpose(0, 2, 1, 3), cos, sin)
        k = _rope(k.transpose(0, 2, 1, 3), cos, sin)
        v = v.transpose(0, 2, 1, 3)
        q = (q * scale).reshape(b, nkv, group * t, d)
        # Softmax in place: these (batch, heads, length, length) arrays are
        # the largest of a layer.
        pr = q @ k.transpose(0, 1, 3, 2)
        pr += masks[kind]
        pr -= pr.max(-1, keepdims=True)
        np.exp(pr, out=pr)
        pr /= pr.sum(-1, keepdims=True)
        o = (pr @ v).reshape(b, nh, t, d).transpose(0, 2, 1, 3).reshape(b, t, nh * d)
        x1 = x + o @ params[p + "self_attn.o_proj.weight"].T
        m, rm = _norm(x1, params[p + "post_attention_layernorm.weight"], eps)
        g = m @ params[p + "mlp.gate_proj.weight"].T
        u = m @ params[p + "mlp.up_proj.weight"].T
        sg = 1 / (1 + np.exp(-g))
        hid = g * sg * u
        x2 = x1 + hid @ params[p + "mlp.down_proj.weight"].T
        saved.append((x, a, ra, q, k, v, pr, o, x1, m, rm, g, u, sg, hid))
        x = x2
    f, rf = _norm(x, params["model.norm.weight"], eps)
    # The cross-entropy and its gradient, softmax(logits) - onehot, in place.
    dl = f @ params["lm_head.weight"].T
    dl -= dl.max(-1, keepdims=True)
    picked = np.take_along_axis(dl, targets[..., None], -1)
    np.exp(dl, out=dl)
    z = dl.sum(-1, keepdims=True)
    loss = float((np.log(z) - picked).mean())

    grads = {}
    dl /= z
    np.put_along_axis(
        dl, targets[..., None], np.take_along_axis(dl, targets[..., None], -1) - 1, -1
    )
    dl /= b * t
    grads["lm_head.weight"] = dl.reshape(-1, dl.shape[-1]).T @ f.reshape(-1, h)
    dx, grads["model.norm.weight"] = _norm_back(
        dl @ params["lm_head.weight"], x, params["model.norm.weight"], rf
    )
    for n in reversed(range(len(config["layer_types"]))):
        p = f"model.layers.{n}."
        x0, a, ra, q, k, v, pr, o, x1, m, rm, g, u, sg, hid = saved[n]
        flat = dx.reshape(-1, h)
        grads[p + "mlp.down_proj.weight"] = flat.T @ hid.reshape(-1, hid.shape[-1])
        dhid = dx @ params[p + "mlp.down_proj.weight"]
        du = dhid * g * sg
        dg = dhid * u * sg * (1 + g * (1 - sg))
        grads[p + "mlp.up_proj.weight"] = du.reshape(-1, du.shape[-1]).T @ m.reshape(
            -1, h
        )
        grads[p + "mlp.gate_proj.weight"] = dg.reshape(-1, dg.shape[-1]).T @ m.reshape(
            -1, h
        )
        dm = (
            du @ params[p + "mlp.up_proj.weight"]
            + dg @ params[p + "mlp.gate_proj.weight"]
        )
        dn, grads[p + "post_attention_layernorm.weight"] = _norm_back(
            dm, x1, params[p + "post_attention_layernorm.weight"], rm
        )
        dx1 = dx + dn
        grads[p + "self_attn.o_proj.weight"] = dx1.reshape(-1, h).T @ o.reshape(
            -1, nh * d
        )
        do = (
            (dx1 @ params[p + "self_attn.o_proj.weight"])
            .reshape(b, t, nh, d)
            .transpose(0, 2, 1, 3)
            .reshape(b, nkv, group * t, d)
        )
        dv = pr.transpose(0, 1, 3, 2) @ do
        ds = do @ v.transpose(0, 1, 3, 2)
        ds -= (ds * pr).sum(-1, keepdims=True)
        ds *= pr
        dq = ((ds @ k) * scale).reshape(b, nh, t, d)
        dk = ds.transpose(0, 1, 3, 2) @ q
        dq = _rope(dq, cos, sin, -1).transpose(0, 2, 1, 3).reshape(b, t, nh * d)
        dk = _rope(dk, cos, sin, -1).transpose(0, 2, 1, 3).reshape(b, t, nkv * d)
        dv = dv.transpose(0, 2, 1, 3).reshape(b, t, nkv * d)
        af = a.reshape(-1, h)
        da = 0
        for name, dy in (("q_proj", dq), ("k_proj", dk), ("v_proj", dv)):
            w = params[p + f"self_attn.{name}.weight"]
            grads[p + f"self_attn.{name}.weight"] = dy.reshape(-1, w.shape[0]).T @ af
            da = da + dy @ w
        dn, grads[p + "input_layernorm.weight"] = _norm_back(
            da, x0, params[p + "input_layernorm.weight"], ra
        )
        dx = dx1 + dn
    de = np.zeros_like(params["model.embed_tokens.weight"])
    np.add.at(de, inputs.reshape(-1), dx.reshape(-1, h))
    grads["model.embed_tokens.weight"] = de
    return loss, grads


def train(ids, config=CONFIG, recipe=RECIPE, progress=None):
    """AdamW on random windows of ``ids`` (one token stream); returns the
    parameters (float32 numpy arrays named as mlx-lm's llama names them)."""
    rng = np.random.default_rng(recipe["seed"])
    params = init_params(config, rng)
    mom = {k: np.zeros_like(v) for k, v in params.items()}
    vel = {k: np.zeros_like(v) for k, v in params.items()}
    steps, t, b1, b2 = recipe["steps"], recipe["length"], 0.9, 0.99
    for step in range(1, steps + 1):
        start = rng.integers(0, len(ids) - t - 1, recipe["batch"])
        window = np.stack([ids[s : s + t + 1] for s in start])
        loss, grads = loss_and_grads(params, config, window[:, :-1], window[:, 1:])
        # Warm-up, then a cosine from ``lr`` down to ``lr * lr_end``.
        end, warm = recipe["lr_end"], min(1.0, step / 20)
        cosine = end + (1 - end) * 0.5 * (1 + np.cos(np.pi * step / steps))
        lr = np.float32(recipe["lr"] * warm * cosine)
        for k, g in grads.items():
            mom[k] = b1 * mom[k] + (1 - b1) * g
            vel[k] = b2 * vel[k] + (1 - b2) * g * g
            update = mom[k] / (1 - b1**step) / (np.sqrt(vel[k] / (1 - b2**step)) + 1e-8)
            decay = 0.01 * params[k] if params[k].ndim == 2 else 0
            params[k] -= (lr * (update + decay)).astype(np.float32)
        if progress:
            progress(step, loss)
    return params


def build(path, config=CONFIG, recipe=RECIPE):
    """Train the tokenizer and the model; write a model directory to ``path``."""
    import mlx.core as mx
    from tqdm import tqdm

    path = Path(path)
    texts = corpus()
    tokenizer = tiny.bpe_tokenizer(texts, config["vocab_size"])
    eos = tokenizer.token_to_id("<|endoftext|>")
    ids = np.concatenate([e.ids + [eos] for e in tokenizer.encode_batch(texts)])
    bar = tqdm(
        total=recipe["steps"],
        desc="training the demo model (once)",
        unit="step",
        file=sys.stderr,
    )

    def progress(step, loss):
        bar.set_postfix(loss=f"{loss:.2f}", refresh=False)
        bar.update()

    params = train(ids.astype(np.int32), config, recipe, progress)
    bar.close()
    weights = {k: mx.array(v) for k, v in params.items()}
    mx.save_safetensors(str(path / "model.safetensors"), weights, {"format": "mlx"})
    (path / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
    tiny.write_tokenizer(path, tokenizer.to_str())
    return path


def home() -> Path:
    default = Path.home() / ".cache" / "mlx_lm_patched"
    return Path(os.environ.get("MLX_LM_PATCHED_HOME", default))


def demo_model_dir(path: Optional[Union[str, Path]] = None) -> Path:
    """The demo model: a small llama with sliding and full layers trained on
    the standard library's sources (this module), trained once in a
    subprocess (about two CPU-minutes, one core) and reused while its stamp
    (``stamp()``: config, recipe, the trainer's source, Python's
    and the libraries' versions) stays the same. By default it lives in
    ``home()/demo-model-<digest of the stamp>``: each trainer finds its own
    model, never one that another made."""
    made_of = stamp()
    if path is None:
        digest = hashlib.sha256(json.dumps(made_of, sort_keys=True).encode())
        path = home() / f"demo-model-{digest.hexdigest()[:12]}"
    path = Path(path)
    if (path / "config.json").exists():
        made = path / "training.json"
        if made.exists() and json.loads(made.read_text()) == made_of:
            return path
        shutil.rmtree(path)
    # Build beside the target and rename, so a concurrent reader never sees
    # a half-written directory.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-model-", dir=path.parent))
    try:
        # One BLAS thread: the same sums in the same order on every machine,
        # and no spinning threads on a shared CPU.
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
        recipe = json.dumps(made_of["recipe"])
        cmd = [sys.executable, "-m", "mlx_lm_patched.demo.tiny_train", str(tmp)]
        subprocess.run(cmd + ["--recipe", recipe], env=env, check=True)
        (tmp / "training.json").write_text(json.dumps(made_of, indent=2))
        tmp.rename(path)
    except OSError:
        pass  # another process won the race
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def stamp():
    """What the demo model is made from: ``CONFIG``, ``RECIPE``, a digest of
    the trainer's source (this module, ``tiny``'s tokenizer), and the
    versions of Python (its standard library is the corpus) and of the
    libraries that train it. A model made from another stamp is stale."""
    import tokenizers

    source = Path(__file__).read_text() + "".join(
        inspect.getsource(f) for f in (tiny.bpe_tokenizer, tiny.write_tokenizer)
    )
    return {
        "config": CONFIG,
        "recipe": RECIPE,
        "trainer": hashlib.sha256(source.encode()).hexdigest(),
        "python": sys.version,
        "numpy": np.__version__,
        "tokenizers": tokenizers.__version__,
    }


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="mlx_lm_patched.demo.tiny_train", description=__doc__.splitlines()[0]
    )
    parser.add_argument("path")
    parser.add_argument("--recipe", type=json.loads, default=RECIPE)
    args = parser.parse_args(argv)
    build(args.path, CONFIG, args.recipe)


if __name__ == "__main__":
    main()
