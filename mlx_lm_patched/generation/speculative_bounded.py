"""Speculative decoding with a bounded cache: ``--draft-model`` with
``--max-kv-size`` and on sliding-window models.

Upstream's ``stream_generate`` drops ``max_kv_size`` whenever a draft model
is given (the cache grows without bound), and on a model with sliding
layers, once a ring wraps, ``speculative_generate_step``'s trims of the
rejected draft tokens silently do nothing (``trim_prompt_cache`` returns 0):
the rejected tokens stay in the ring and the output drifts from the
no-draft output a few tokens after the wrap. Here ``stream_generate`` builds
the model's and the draft's caches with ``max_kv_size`` and gives every
rotating layer ``slack`` for ``num_draft_tokens`` (``RotatingKVCache``
steps back that many tokens exactly after a wrap, see ``rotating_prealloc``);
a trim it still cannot do exactly returns 0 (``ring_trim_slack``). Greedy tokens equal
the no-draft run's with the same ``max_kv_size``, also with ``kv_bits``: the
quantized ring keeps the slack (``quantized_ring``).
"""

from typing import TYPE_CHECKING, Generator, List, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse, generation_stream
from mlx_lm.tokenizer_utils import TokenizerWrapper
from transformers import PreTrainedTokenizer

from .._registry import Patch, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    import time

    from mlx_lm.generate import (
        generate_step,
        make_prompt_cache,
        speculative_generate_step,
        wired_limit,
    )


# Written as they read in mlx_lm/generate.py, and run there.
def _give_slack(prompt_cache, num_draft_tokens):
    """Let every rotating layer step back ``num_draft_tokens`` after a wrap
    (``kv_bits`` quantizes a ring into one that keeps the slack)."""
    for c in prompt_cache:
        if hasattr(c, "slack") and c.slack < num_draft_tokens:
            if num_draft_tokens > c.max_size - c.keep:
                raise ValueError(
                    f"num_draft_tokens {num_draft_tokens} does not fit a rotating "
                    f"cache of {c.max_size} tokens (keep {c.keep})"
                )
            c.slack = num_draft_tokens


def stream_generate(
    model: nn.Module,
    tokenizer: Union[PreTrainedTokenizer, TokenizerWrapper],
    prompt: Union[str, mx.array, List[int]],
    max_tokens: int = 256,
    draft_model: Optional[nn.Module] = None,
    stream: mx.Stream | mx.ThreadLocalStream = generation_stream,
    **kwargs,
) -> Generator[GenerationResponse, None, None]:
    """
    A generator producing text based on the given prompt from the model.

    Args:
        model (nn.Module): The model to use for generation.
        tokenizer (PreTrainedTokenizer): The tokenizer.
        prompt (Union[str, mx.array, List[int]]): The input prompt string or
          integer tokens.
        max_tokens (int): The maximum number of tokens to generate.
          Default: ``256``.
        draft_model (Optional[nn.Module]): An optional draft model. If provided
          then speculative decoding is used. The draft model must use the same
          tokenizer as the main model. Default: ``None``.
        kwargs: The remaining options get passed to :func:`generate_step`.
          See :func:`generate_step` for more details.

    Yields:
        GenerationResponse: An instance containing the generated text segment and
            associated metadata. See :class:`GenerationResponse` for details.
    """
    if max_tokens == 0:
        raise ValueError(
            "Maximum number of tokens must be non-zero (use -1 for no limit)."
        )

    if not isinstance(tokenizer, TokenizerWrapper):
        tokenizer = TokenizerWrapper(tokenizer)

    if not isinstance(prompt, mx.array):
        if isinstance(prompt, str):
            # Try to infer if special tokens are needed
            add_special_tokens = tokenizer.bos_token is None or not prompt.startswith(
                tokenizer.bos_token
            )
            prompt = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        prompt = mx.array(prompt)

    detokenizer = tokenizer.detokenizer

    kwargs["max_tokens"] = max_tokens

    if draft_model is None:
        kwargs.pop("num_draft_tokens", None)
        token_generator = generate_step(prompt, model, stream, **kwargs)
        # from_draft always false for non-speculative generation
        token_generator = (
            (token, logprobs, False) for token, logprobs in token_generator
        )
    else:
        max_kv_size = kwargs.pop("max_kv_size", None)
        kwargs.pop("prompt_progress_callback", None)
        if kwargs.pop("input_embeddings", None) is not None:
            raise ValueError("Speculative decoding does not support input embeddings.")
        if kwargs.get("prompt_cache") is None:
            kwargs["prompt_cache"] = make_prompt_cache(
                model, max_kv_size
            ) + make_prompt_cache(draft_model, max_kv_size)
        # speculative_generate_step's default: 2 draft tokens.
        num_draft_tokens = kwargs.get("num_draft_tokens", 2)
        _give_slack(kwargs["prompt_cache"], num_draft_tokens)
        token_generator = speculative_generate_step(
            prompt, model, draft_model, stream, **kwargs
        )

    def response(finish_reason=None):
        return GenerationResponse(
            text=detokenizer.last_segment,
            token=token,
            logprobs=logprobs,
            from_draft=from_draft,
            prompt_tokens=prompt.size,
            prompt_tps=prompt_tps,
            generation_tokens=n + 1,
            generation_tps=(n + 1) / (time.perf_counter() - tic),
            peak_memory=mx.get_peak_memory() / 1e9,
            finish_reason=finish_reason,
        )

    with wired_limit(model, [stream]):
        tic = time.perf_counter()
        for n, (token, logprobs, from_draft) in enumerate(token_generator):
            if n == 0:
                prompt_time = time.perf_counter() - tic
                prompt_tps = prompt.size / prompt_time
                tic = time.perf_counter()
            if token in tokenizer.eos_token_ids:
                break

            detokenizer.add_token(token)
            if (n + 1) == max_tokens:
                break

            yield response()

        detokenizer.finalize()
        yield response("stop" if token in tokenizer.eos_token_ids else "length")


PATCH = Patch(
    "speculative_bounded",
    "stream_generate: --draft-model keeps --max-kv-size; rotating layers get "
    "slack for the rejected draft tokens",
    targets("mlx_lm.generate", _give_slack, stream_generate),
    requires=(
        "mlx_lm.models.cache:RotatingKVCache.trimmable_tokens",
        "mlx_lm.models.cache:trim_prompt_cache",
    ),
)
