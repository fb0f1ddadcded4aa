"""``mlx_lm.server --max-kv-size N`` bounds every conversation's cache.

Upstream's server has no ``--max-kv-size`` (``generate`` has): a long
conversation's cache grows with it, and so does every prompt cache entry
(ml-explore/mlx-lm#126 asks for it). Here the server takes the flag
(``server_prompt_cache``'s parser) and every cache it makes is
``make_prompt_cache(model, max_kv_size)``: full-attention layers are rings
of N tokens keeping the first 4, sliding layers keep a window no larger
(``max_kv_size``). Requests served one at a time (a seed, images, a draft
model) get them from ``_serve_single`` here, batched ones from
``BatchGenerator(max_kv_size=...)`` (``server_kv_bits``'s ``_generate``).
The prompt cache, ``--kv-bits`` (quantized rings), ``--prompt-cache-bits``
and ``--prompt-cache-dir`` take the rings as they take a sliding-window
model's.
"""

from typing import TYPE_CHECKING

from .._registry import Patch, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    import mlx.core as mx
    from mlx_lm.server import (
        GenerationContext,
        Response,
        _format_top_logprobs,
        _make_logits_processors,
        _make_sampler,
        make_prompt_cache,
        stream_generate,
    )


# Written as it reads in mlx_lm/server.py, and runs there.
class ResponseGenerator:
    def _serve_single(self, request, stream):
        rqueue, request, args = request

        # Define the progress callback
        def progress(tokens_processed, tokens_total):
            rqueue.put((tokens_processed, tokens_total))

        try:
            # Load the model and tokenizer
            model = self.model_provider.model
            tokenizer = self.model_provider.tokenizer
            draft_model = self.model_provider.draft_model

            # Prepare the prompt and state machine
            prompt, _, _, initial_state, vision = self._tokenize(
                tokenizer, request, args
            )
            stop_sequences, text_sm = self._make_state_machine(
                self.model_provider.model_key,
                tokenizer,
                args.stop_words,
            )

            # Start the generation context
            ctx = GenerationContext(
                has_thinking=tokenizer.has_thinking,
                has_tool_calling=tokenizer.has_tool_calling,
                tool_parser=tokenizer.tool_parser,
                text_sm=text_sm,
                initial_state=initial_state,
                prompt=prompt,
            )
            rqueue.put(ctx)

            # Seed if requested
            if args.seed is not None:
                mx.random.seed(args.seed)

            # Make the sampler and logit processor
            sampler = _make_sampler(args, tokenizer)
            logits_processors = _make_logits_processors(args)

            # Load the KV cache
            self._log_cache_stats()
            cache_key = vision.cache_key if vision is not None else prompt[:]
            cache, rest = self.prompt_cache.fetch_nearest_cache(
                self.model_provider.model_key, cache_key
            )
            ctx.prompt_cache_count = len(prompt) - len(rest)
            rest = prompt[ctx.prompt_cache_count :]
            if cache is None:  # with the server's ring slack and checkpoints
                options = (
                    getattr(self.cli_args, "max_kv_size", None),
                    getattr(self.cli_args, "prompt_cache_slack", 0),
                    getattr(self.cli_args, "prompt_cache_checkpoint_every", 0),
                )
                cache = make_prompt_cache(self.model_provider.model, *options)
                if self.model_provider.draft_model is not None:
                    cache += make_prompt_cache(
                        self.model_provider.draft_model, *options
                    )

            # The images after the cached tokens.
            input_embeddings = None
            if vision is not None:
                n = sum(i < ctx.prompt_cache_count for i in vision.starts)
                if pixel_values := vision.pixel_values[n:]:
                    input_embeddings = model.embed_inputs(
                        mx.array(rest), pixel_values=pixel_values
                    )
                    # The prefill runs on another stream: compute the vision rows first.
                    mx.eval(input_embeddings)

            # Process the prompt and generate tokens
            # Own matcher: the automaton is cached across requests.
            stop_matcher = stop_sequences.matcher()
            for gen in stream_generate(
                model=model,
                stream=stream,
                tokenizer=tokenizer,
                prompt=rest,
                max_tokens=args.max_tokens,
                sampler=sampler,
                logits_processors=logits_processors,
                prompt_cache=cache,
                draft_model=draft_model,
                num_draft_tokens=args.num_draft_tokens,
                input_embeddings=input_embeddings,
                prompt_progress_callback=progress,
                prefill_step_size=self.cli_args.prefill_step_size,
                kv_bits=self.cli_args.kv_bits,
                kv_group_size=self.cli_args.kv_group_size,
                quantized_kv_start=self.cli_args.quantized_kv_start,
            ):
                finish_reason = gen.finish_reason

                # Token-level stop word detection
                if stop_matcher.advance(gen.token):
                    finish_reason = "stop"

                rqueue.put(
                    Response(
                        gen.text,
                        gen.token,
                        gen.logprobs[gen.token].item(),
                        finish_reason,
                        _format_top_logprobs(
                            gen.logprobs, args.top_logprobs, tokenizer
                        ),
                    )
                )
                cache_key.append(gen.token)

                if ctx._should_stop:
                    if self._is_distributed:
                        raise NotImplementedError()
                    break

                if finish_reason is not None:
                    break

            rqueue.put(None)

            # Save the KV cache again
            self.prompt_cache.insert_cache(
                self.model_provider.model_key, cache_key, cache
            )

        except Exception as e:
            rqueue.put(e)


PATCH = Patch(
    "server_max_kv_size",
    "server: --max-kv-size N makes every conversation's cache a ring of N tokens",
    targets("mlx_lm.server:ResponseGenerator", ResponseGenerator),
    requires=(
        "mlx_lm.models.cache:_bound_layers",
        "mlx_lm.models.cache:make_prompt_cache",  # slack, checkpoint_every
    ),
)
