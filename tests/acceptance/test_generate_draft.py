"""``generate --draft-model`` with a bounded cache gives the tokens of the
same command without the draft: with ``--max-kv-size`` (upstream drops the
bound when a draft model is given) and on gemma3_text's sliding layers
(upstream keeps rejected draft tokens in a wrapped ring and drifts), also
with ``--kv-bits``."""

import pytest
from harness import LONG, generate, text_of


def tokens(model, *flags, upstream=False):
    return text_of(generate(model, LONG, *flags, upstream=upstream, max_tokens=64))


KV4 = ["--kv-bits", 4, "--kv-group-size", 32, "--quantized-kv-start", 0]


@pytest.mark.parametrize(
    "name, flags",
    [
        ("llama", ["--max-kv-size", 48]),
        ("gemma3_text", []),
        ("llama", ["--max-kv-size", 48, *KV4]),  # a quantized ring steps back too
        ("gemma3_text", KV4),
    ],
)
def test_draft_gives_the_no_draft_tokens(model_dir, make_tiny_dir, name, flags):
    # A draft of other random weights: some drafts are rejected and trimmed.
    draft = ["--draft-model", make_tiny_dir(name, seed=1), "--num-draft-tokens", 3]
    model = model_dir(name)
    assert tokens(model, *flags, *draft) == tokens(model, *flags)


def test_upstream_draft_drifts_on_sliding_layers(model_dir, make_tiny_dir):
    draft = ["--draft-model", make_tiny_dir("gemma3_text", seed=1)]
    model = model_dir("gemma3_text")
    with_draft = tokens(model, *draft, "--num-draft-tokens", 3, upstream=True)
    assert with_draft != tokens(model, upstream=True)
