"""The server keeps batching with ``--kv-bits``.

Upstream's server serves every request one at a time once ``--kv-bits`` is
given (``_is_batchable``), because ``BatchGenerator`` had no ``kv_bits``.
With ``batch_generator_kv_bits`` it has: requests are batched as without
``--kv-bits``, and ``_generate`` hands the server's ``--kv-bits``,
``--kv-group-size`` and ``--quantized-kv-start`` to its ``BatchGenerator``,
and ``--max-kv-size`` (``server_max_kv_size``).

``_generate`` also holds the prompt cache and the running batch within
``--prompt-cache-bytes`` after every batch step (upstream does only when a
request joins the batch, so the caches a step inserts and the batch's growth
went past it; ml-explore/mlx-lm#1390, #1807).

A request whose sampler or logits processor raises in a batch step (a
``top_k`` or ``logit_bias`` id past the vocabulary) gets the error and
leaves the batch (``_failing_alone``); upstream's step raised out of
``_generate`` and ended the generation thread with every request in it
(see ``server_failures``).

A prompt cache with a disk tier (``DiskLRUPromptCache``) is given the batch
generator's prefill counters, from which it measures how fast prompts are
prefilled and so whether a restore from disk pays (``prompt_cache_disk``).
"""

from typing import TYPE_CHECKING

from .._registry import Patch, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    import gc
    import logging
    import time

    import mlx.core as mx
    from mlx_lm.server import (
        BatchGenerator,
        GenerationContext,
        Response,
        _format_top_logprobs,
        _image_parts,
        _make_logits_processors,
        _make_sampler,
        make_prompt_cache,
    )


# Written as it reads in mlx_lm/server.py, and run there.
def _failing_alone(fn, errors, fallback):
    """``fn``, keeping what it raises in ``errors`` and answering as
    ``fallback`` instead: one request's sampler or logits processor fails
    that request, not the batch step."""

    def call(*args):
        try:
            return fn(*args)
        except Exception as e:
            errors.append(e)
            return fallback(*args)

    return call


def _log_timing(timing, phase):
    """Log a request's breakdown at DEBUG: the milliseconds each phase took
    (``first_token``: from joining the batch, ``segments`` the inserts at
    its segments' ends within it; ``store``: its entry's insert once
    answered), each phase logged once."""
    if phase in timing:
        return
    timing[phase] = time.perf_counter()
    if phase == "first_token":
        steps = ("tokenize", "prepare", "fetch", "insert", "first_token")
        before = ["start", *steps]
    else:
        steps, before = ("store",), ("done",)
    parts = " ".join(
        f"{k}={(timing[k] - timing[b]) * 1e3:.1f}ms" for k, b in zip(steps, before)
    )
    if phase == "first_token":  # of which the inserts at segment ends
        parts += f" segments={timing.get('segments', 0.0) * 1e3:.1f}ms"
    logging.debug(f"prompt-cache timing: {parts}")


class ResponseGenerator:
    def _is_batchable(self, args):
        return self.model_provider.is_batchable and args.seed is None

    def _generate(self):
        # Local thread stream that we 'll pass to the BatchGenerator to make
        # sure that all generation runs in the same stream as the
        # synchronization messages.
        generation_stream = mx.default_stream(mx.default_device())

        # Load the default model if it is given
        self.model_provider.load_default()

        current_model = None
        current_tokenizer = None
        current_model_key = None
        batch_generator = None
        drain_batch = False
        batch_results = {}

        unprocessed_requests = []

        def get_next_request(timeout=None):
            if unprocessed_requests:
                return unprocessed_requests.pop()
            else:
                return self._next_request(timeout)

        def hold_prompt_cache_bytes():
            # The prompt cache and the running batch within --prompt-cache-bytes
            if self.model_provider.cli_args.prompt_cache_bytes is not None:
                total = self.model_provider.cli_args.prompt_cache_bytes
                active = batch_generator.prompt_cache_nbytes
                self.prompt_cache.trim_to(n_bytes=total - active)

        if self._is_distributed:
            seed = mx.distributed.all_sum(mx.random.state[0]).view(mx.uint64).item()
            mx.random.seed(seed)

        while not self._stop:
            request = None
            if not drain_batch:
                timeout = (
                    None
                    if (batch_generator is not None and len(batch_results) > 0)
                    else 0.1
                )
                request = get_next_request(timeout=timeout)

            # We got a request
            if request is not None:
                rqueue, request, args = request

                # Requests with images are served sequentially.
                batchable = self._is_batchable(args) and not any(
                    _image_parts(request.messages)
                )

                # Can it be added to the current batch?
                if (
                    batch_generator is not None
                    and current_model == args.model
                    and batchable
                ):
                    timing = {"start": time.perf_counter()}
                    try:
                        prompt, segments, segment_types, initial_state, _ = (
                            self._tokenize(current_tokenizer, request, args)
                        )
                        timing["tokenize"] = time.perf_counter()
                        # server_failures: what a request's arguments raise,
                        # here or in a batch step, fails that request alone.
                        stop_sequences, text_sm = self._make_state_machine(
                            self.model_provider.model_key,
                            current_tokenizer,
                            args.stop_words,
                        )
                        errors = []
                        sampler = _failing_alone(
                            _make_sampler(args, current_tokenizer),
                            errors,
                            lambda logprobs: mx.argmax(logprobs, axis=-1),
                        )
                        logits_processors = [
                            _failing_alone(p, errors, lambda _, logits: logits)
                            for p in _make_logits_processors(args)
                        ]
                    except Exception as e:
                        rqueue.put(e)
                        continue

                    self._log_cache_stats()
                    timing["prepare"] = time.perf_counter()
                    cache, rest = self.prompt_cache.fetch_nearest_cache(
                        current_model_key, prompt
                    )
                    if cache is None:  # rings with the server's slack, checkpoints
                        cache = make_prompt_cache(
                            self.model_provider.model,
                            getattr(self.cli_args, "max_kv_size", None),
                            getattr(self.cli_args, "prompt_cache_slack", 0),
                            getattr(self.cli_args, "prompt_cache_checkpoint_every", 0),
                        )
                    timing["fetch"] = time.perf_counter()
                    prompt_cache_count = len(prompt) - len(rest)
                    N = prompt_cache_count
                    while N > 0:
                        if N >= len(segments[0]):
                            N -= len(segments.pop(0))
                            segment_types.pop(0)
                        else:
                            segments[0] = segments[0][N:]
                            break

                    ctx = GenerationContext(
                        has_tool_calling=current_tokenizer.has_tool_calling,
                        has_thinking=current_tokenizer.has_thinking,
                        tool_parser=current_tokenizer.tool_parser,
                        text_sm=text_sm,
                        initial_state=initial_state,
                        prompt=prompt,
                        prompt_cache_count=prompt_cache_count,
                    )
                    rqueue.put(ctx)

                    (uid,) = batch_generator.insert_segments(
                        segments=[segments],
                        max_tokens=[args.max_tokens],
                        caches=[cache],
                        all_tokens=[prompt[:prompt_cache_count]],
                        samplers=[sampler],
                        logits_processors=[logits_processors],
                        stop_sequences=[stop_sequences],
                    )
                    batch_results[uid] = {
                        "ctx": ctx,
                        "rqueue": rqueue,
                        "detokenizer": current_tokenizer.detokenizer,
                        "segment_types": segment_types[::-1],
                        "top_logprobs": args.top_logprobs,
                        "errors": errors,
                        "timing": timing,
                    }
                    timing["insert"] = time.perf_counter()
                    # just making sure we don't leave a reference around
                    del cache

                    hold_prompt_cache_bytes()
                    continue

                # No batch generator. Load the model and if it's not
                # batchable serve sequential, o/w make a batch generaotr and
                # serve batched
                elif batch_generator is None:
                    try:
                        model, tokenizer = self.model_provider.load(
                            args.model.model, args.model.adapter, args.model.draft
                        )
                    except Exception as e:
                        rqueue.put(e)
                        continue

                    if not batchable:
                        self._serve_single((rqueue, request, args), generation_stream)
                        continue

                    current_model = args.model
                    current_tokenizer = tokenizer
                    current_model_key = self.model_provider.model_key
                    batch_results = {}
                    batch_generator = BatchGenerator(
                        model,
                        completion_batch_size=self.cli_args.decode_concurrency,
                        prefill_batch_size=self.cli_args.prompt_concurrency,
                        prefill_step_size=self.cli_args.prefill_step_size,
                        stream=generation_stream,
                        max_kv_size=getattr(self.cli_args, "max_kv_size", None),
                        kv_bits=self.cli_args.kv_bits,
                        kv_group_size=self.cli_args.kv_group_size,
                        quantized_kv_start=self.cli_args.quantized_kv_start,
                    )
                    # The disk tier's cost model reads how fast it prefills.
                    if hasattr(self.prompt_cache, "prefill_counters"):
                        self.prompt_cache.prefill_counters = batch_generator._counters
                    unprocessed_requests.append((rqueue, request, args))
                    continue

                # We have a batch but this request cannot be added to the
                # batch so drain it to process the request.
                else:
                    drain_batch = True
                    unprocessed_requests.append((rqueue, request, args))
                    continue

            # No request so serve from the current batch
            elif batch_generator is not None:
                if len(batch_results) == 0:
                    if drain_batch:
                        current_model = None
                        current_tokenizer = None
                        current_model_key = None
                        batch_generator.close()
                        batch_generator = None
                        drain_batch = False
                    continue

                uids_to_remove = []
                for _ in self._time_budget:
                    if self._stop:  # server_http: stopped at the next step
                        break
                    prompt_responses, gen_responses = batch_generator.next()
                    # server_failures: a request whose sampler or logits
                    # processor raised gets the error and leaves the batch.
                    for result in batch_results.values():
                        if result["errors"] and not result["ctx"]._should_stop:
                            result["rqueue"].put(result["errors"][0])
                            result["ctx"].stop()
                    if not prompt_responses and not gen_responses:
                        break

                    # Progress report for prompt processing
                    for r in prompt_responses:
                        result = batch_results[r.uid]
                        result["rqueue"].put(r.progress)
                        if result["ctx"]._should_stop:
                            uids_to_remove.append(r.uid)

                    # Save the caches at end of segments
                    eos_ids = [
                        r.uid
                        for r in prompt_responses
                        if r.end_of_segment
                        and not r.end_of_prompt
                        and batch_results[r.uid]["segment_types"]
                    ]
                    caches = batch_generator.extract_cache(eos_ids)
                    for uid, (cache, cache_key) in caches.items():
                        timing = batch_results[uid]["timing"]
                        at = time.perf_counter()
                        self.prompt_cache.insert_cache(
                            self.model_provider.model_key,
                            cache_key[:],
                            cache,
                            cache_type=batch_results[uid]["segment_types"].pop(),
                        )
                        timing["segments"] = timing.get("segments", 0.0) + (
                            time.perf_counter() - at
                        )
                    del caches

                    for r in gen_responses:
                        result = batch_results[r.uid]
                        _log_timing(result["timing"], "first_token")

                        # Don't decode the final stop token
                        if r.finish_reason == "stop":
                            result["detokenizer"].finalize()
                            text = result["detokenizer"].last_segment
                        elif r.finish_reason == "length":
                            result["detokenizer"].add_token(r.token)
                            result["detokenizer"].finalize()
                            text = result["detokenizer"].last_segment
                        else:
                            result["detokenizer"].add_token(r.token)
                            text = result["detokenizer"].last_segment

                        result["rqueue"].put(
                            Response(
                                text,
                                r.token,
                                r.logprobs[r.token].item(),
                                r.finish_reason,
                                _format_top_logprobs(
                                    r.logprobs,
                                    result["top_logprobs"],
                                    current_tokenizer,
                                ),
                            )
                        )

                        if r.finish_reason is not None:
                            result["rqueue"].put(None)
                            result["timing"]["done"] = time.perf_counter()
                            self.prompt_cache.insert_cache(
                                current_model_key,
                                r.all_tokens[:],
                                r.prompt_cache,
                                cache_type="assistant",
                            )
                            _log_timing(result["timing"], "store")
                            del batch_results[r.uid]

                        if result["ctx"]._should_stop:
                            uids_to_remove.append(r.uid)

                    hold_prompt_cache_bytes()

                uids_to_remove = self._share_object(uids_to_remove)
                if uids_to_remove:
                    batch_generator.remove(uids_to_remove)
                    for uid in uids_to_remove:
                        # It may have already been removed during
                        # generation
                        batch_results.pop(uid, None)

        # Make sure the model and prompt cache are destroyed in the generation
        # thread under same stream.
        self.model_provider.reset()
        del self.prompt_cache
        gc.collect()


PATCH = Patch(
    "server_kv_bits",
    "server: batch requests with --kv-bits, passing it to BatchGenerator",
    targets("mlx_lm.server", _failing_alone, _log_timing)
    + targets("mlx_lm.server:ResponseGenerator", ResponseGenerator),
    requires=(
        "mlx_lm.generate:BatchGenerator.__init__",  # kv_bits
        "mlx_lm.models.cache:make_prompt_cache",  # slack, checkpoint_every
    ),
)
