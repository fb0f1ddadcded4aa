"""``generate`` checks ``--kv-bits`` and ``--kv-group-size`` before the first token.

Upstream validates KV quantization only when a cache reaches
``quantized_kv_start`` tokens (5,000 by default): ``--kv-bits 16`` runs for
thousands of tokens, then fails mid-generation. And ``generate
--prompt-cache-file`` compares ``--kv-group-size`` with the group size the
file holds, so a quantized cache whose group size was lowered to fit its
head dims (96 with 64 quantizes with 32) is refused by the very command
that wrote it. Here ``maybe_quantize_kv_cache`` raises a ``ValueError``
naming ``kv_bits``/``kv_group_size`` and the valid values at the first model
call, and ``main`` asks the loaded cache whether it quantizes with the
requested group size (``QuantizedKVCache.quantizes_with``). A cache file
whose layer count or head layout is not the model's (upstream runs a 4-layer
cache on a 2- or 6-layer model with no error) is refused before the first
token (``prompt_cache_mismatch``).
"""

from typing import TYPE_CHECKING

from .._registry import Patch, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    import json
    import sys

    import mlx.core as mx
    import numpy as np
    from mlx_lm.generate import (
        DEFAULT_MODEL,
        QuantizedKVCache,
        generate,
        load,
        load_processor,
        load_prompt_cache,
        make_prompt_cache,
        make_sampler,
        setup_arg_parser,
    )

# Written as they read in mlx_lm/generate.py, and run there.


def _check_kv_quantization(kv_bits, kv_group_size):
    """Refuse what ``mx.quantize`` cannot do at the first model call, not
    when the cache reaches ``quantized_kv_start`` tokens."""
    if kv_bits not in (2, 3, 4, 5, 6, 8):
        raise ValueError(
            f"kv_bits (--kv-bits) must be 2, 3, 4, 5, 6 or 8, got {kv_bits}"
        )
    if kv_group_size not in (32, 64, 128):
        raise ValueError(
            f"kv_group_size (--kv-group-size) must be 32, 64 or 128, got {kv_group_size}"
        )


def maybe_quantize_kv_cache(prompt_cache, quantized_kv_start, kv_group_size, kv_bits):
    if kv_bits is None:
        return
    _check_kv_quantization(kv_bits, kv_group_size)
    for e, c in enumerate(prompt_cache):
        if hasattr(c, "to_quantized") and c.offset >= quantized_kv_start:
            prompt_cache[e] = c.to_quantized(group_size=kv_group_size, bits=kv_bits)


def main():
    parser = setup_arg_parser()
    args = parser.parse_args()

    if args.seed is not None:
        mx.random.seed(args.seed)

    # Load the prompt cache and metadata if a cache file is provided
    using_cache = args.prompt_cache_file is not None
    if using_cache:
        prompt_cache, metadata = load_prompt_cache(
            args.prompt_cache_file,
            return_metadata=True,
        )
        if isinstance(prompt_cache[0], QuantizedKVCache):
            if args.kv_bits is not None and args.kv_bits != prompt_cache[0].bits:
                raise ValueError(
                    "--kv-bits does not match the kv cache loaded from --prompt-cache-file."
                )
            if not prompt_cache[0].quantizes_with(args.kv_group_size):
                raise ValueError(
                    "--kv-group-size does not match the kv cache loaded from --prompt-cache-file."
                )

    # Building tokenizer_config
    tokenizer_config = (
        {} if not using_cache else json.loads(metadata["tokenizer_config"])
    )
    tokenizer_config["trust_remote_code"] = args.trust_remote_code

    model_path = args.model
    if using_cache:
        if model_path is None:
            model_path = metadata["model"]
        elif model_path != metadata["model"]:
            raise ValueError(
                f"Providing a different model ({model_path}) than that "
                f"used to create the prompt cache ({metadata['model']}) "
                "is an error."
            )
    model_path = model_path or DEFAULT_MODEL

    model, tokenizer, config = load(
        model_path,
        adapter_path=args.adapter_path,
        tokenizer_config=tokenizer_config,
        model_config={"quantize_activations": args.quantize_activations},
        return_config=True,
        trust_remote_code=args.trust_remote_code,
    )
    if using_cache:
        # A cache of other layers or head dims runs on, or fails mid-generation.
        from .models.cache import prompt_cache_layout, prompt_cache_mismatch

        probe = make_prompt_cache(model)
        model(mx.array([[0]]), cache=probe)
        mismatch = prompt_cache_mismatch(prompt_cache_layout(probe), prompt_cache)
        if mismatch is not None:
            raise ValueError(
                f"{args.prompt_cache_file} does not fit the model {model_path}: "
                f"{mismatch}"
            )
    for eos_token in args.extra_eos_token:
        tokenizer.add_eos_token(eos_token)

    template_kwargs = {}
    if args.chat_template_config is not None:
        template_kwargs = json.loads(args.chat_template_config)

    prompt = args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    prompt = sys.stdin.read() if prompt == "-" else prompt
    use_chat_template = not args.ignore_chat_template and tokenizer.has_chat_template
    if use_chat_template:
        if args.system_prompt is not None:
            messages = [{"role": "system", "content": args.system_prompt}]
        else:
            messages = []
        messages.append({"role": "user", "content": prompt})

        has_prefill = args.prefill_response is not None
        if has_prefill:
            messages.append({"role": "assistant", "content": args.prefill_response})
        prompt = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            continue_final_message=has_prefill,
            add_generation_prompt=not has_prefill,
            **template_kwargs,
        )

        # Treat the prompt as a suffix assuming that the prefix is in the
        # stored kv cache.
        if using_cache:
            messages[-1]["content"] = "<query>"
            test_prompt = tokenizer.apply_chat_template(
                messages,
                tokenize=False,
                continue_final_message=has_prefill,
                add_generation_prompt=not has_prefill,
            )
            prompt = prompt[test_prompt.index("<query>") :]

    if args.image:
        processor = load_processor(model, config)
        if processor is None:
            raise ValueError(f"The model {model_path} does not take images.")
        from PIL import Image

        images = [np.asarray(Image.open(f).convert("RGB")) for f in args.image]
        prompt, pixel_values = processor(prompt, images=images)
    else:
        pixel_values = None
    prompt = tokenizer.encode(prompt, add_special_tokens=not use_chat_template)

    if pixel_values is not None:
        input_embeddings = model.embed_inputs(
            mx.array(prompt), pixel_values=pixel_values
        )
        # The prefill runs on another stream: compute the vision rows first.
        mx.eval(input_embeddings)
    else:
        input_embeddings = None

    if args.draft_model is not None:
        draft_model, draft_tokenizer = load(args.draft_model)
        if draft_tokenizer.vocab_size != tokenizer.vocab_size:
            raise ValueError("Draft model tokenizer does not match model tokenizer.")
    else:
        draft_model = None
    sampler = make_sampler(
        args.temp,
        args.top_p,
        args.min_p,
        args.min_tokens_to_keep,
        top_k=args.top_k,
        xtc_probability=args.xtc_probability,
        xtc_threshold=args.xtc_threshold,
        xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids),
    )
    response = generate(
        model,
        tokenizer,
        prompt,
        max_tokens=args.max_tokens,
        verbose=args.verbose,
        sampler=sampler,
        max_kv_size=args.max_kv_size,
        prefill_step_size=args.prefill_step_size,
        prompt_cache=prompt_cache if using_cache else None,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        quantized_kv_start=args.quantized_kv_start,
        draft_model=draft_model,
        num_draft_tokens=args.num_draft_tokens,
        input_embeddings=input_embeddings,
    )
    if not args.verbose:
        print(response)


PATCH = Patch(
    "generate_kv_checks",
    "generate: --kv-bits/--kv-group-size checked before the first token; a "
    "prompt cache file's lowered group size accepted, one of another layout "
    "refused",
    targets("mlx_lm.generate", _check_kv_quantization, maybe_quantize_kv_cache, main),
    requires=(
        "mlx_lm.models.cache:QuantizedKVCache.quantizes_with",
        "mlx_lm.models.cache:prompt_cache_mismatch",  # main imports it
    ),
)
