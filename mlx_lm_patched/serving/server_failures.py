"""A failing request fails alone; a client that leaves cancels its request.

Upstream's generation thread ends at the first exception a request raises
outside ``_tokenize`` and ``_serve_single`` (a sampler that cannot take its
arguments, stop words it cannot match, a batch step): every later request
fails and /health is 503 until a restart (issue 25). Here ``_run_generate``
runs ``_generate`` again after a failure, failing only the requests the
thread had taken (``_next_request`` keeps them), so those clients get the
error and the requests still queued are served. A failure before any
request was taken (the model does not load) still ends the thread.

An exception from the generation after ``handle_completion`` has its
context dropped the connection with no status; here the client gets the
error (a 400 for a ``ValueError``, else 500; an SSE ``error`` event once a
stream has started). Non-stream replies send their status at the end.

A streaming request stops generating when a write to its client fails;
a non-stream one wrote nothing until the end, so one whose client left
generated to ``max_tokens`` (4 abandoned requests of 10**9 tokens held a
core and slowed everyone else 12x). ``handle_completion`` now looks at the
connection after every token and progress report of a non-stream request
(``_client_disconnected``: a poll, then a peek) and cancels as a stream does.
A request that cannot start because the server is stopping gets a 503.
"""

import json
import logging
import select
import weakref
from typing import TYPE_CHECKING, List

from mlx_lm.server import CompletionRequest

from .._registry import Patch, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    import socket

    from mlx_lm.server import (
        GenerationArguments,
        LogitsProcessorArguments,
        ModelDescription,
        QueueEmpty,
        SamplingArguments,
        TextStateMachine,
        ToolCallFormatter,
    )


# Written as it reads in mlx_lm/server.py, and runs there.
class ResponseGenerator:
    def _run_generate(self):
        # The requests the generation thread took: failed if it fails.
        self._taken = weakref.WeakSet()
        while True:
            try:
                self._generate()
                return
            except Exception as e:
                if self._stop or not self._taken:
                    logging.exception(f"mlx_lm.server generation thread died: {e}")
                    self._generation_failed = True
                    return
                logging.exception(f"mlx_lm.server requests failed: {e}")
                for rqueue in list(self._taken):
                    rqueue.put(e)
                self._taken = weakref.WeakSet()

    def _next_request(self, timeout=None):
        request = None
        if not self._is_distributed or self._rank == 0:
            try:
                if timeout is not None:
                    request = self.requests.get(timeout=timeout)
                else:
                    request = self.requests.get_nowait()
            except QueueEmpty:
                pass
        request = self._share_request(request)
        if request is not None:
            self._taken.add(request[0])
        return request


class APIHandler:
    def _client_disconnected(self):
        """Whether the client closed its end of the connection."""
        try:
            # Polled first: a socket with a timeout waits that long to recv.
            poll = select.poll()
            poll.register(self.connection, select.POLLIN)
            if not poll.poll(0):
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def handle_completion(self, request: CompletionRequest, stop_words: List[str]):
        """
        Generate a response to a prompt and send it to the client in a single batch.

        Args:
            prompt (List[int]): The tokenized prompt.
            stop_words (List[str]): A list of stop words
        """
        args = GenerationArguments(
            model=ModelDescription(
                model=self.requested_model,
                draft=self.requested_draft_model,
                adapter=self.adapter,
            ),
            sampling=SamplingArguments(
                temperature=self.temperature,
                top_p=self.top_p,
                top_k=self.top_k,
                min_p=self.min_p,
                xtc_probability=self.xtc_probability,
                xtc_threshold=self.xtc_threshold,
            ),
            logits=LogitsProcessorArguments(
                logit_bias=self.logit_bias,
                repetition_penalty=self.repetition_penalty,
                repetition_context_size=self.repetition_context_size,
                presence_penalty=self.presence_penalty,
                presence_context_size=self.presence_context_size,
                frequency_penalty=self.frequency_penalty,
                frequency_context_size=self.frequency_context_size,
            ),
            stop_words=stop_words,
            max_tokens=self.max_tokens,
            num_draft_tokens=self.num_draft_tokens,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs,
            seed=self.seed,
            chat_template_kwargs=self.chat_template_kwargs,
        )

        # Keep connection allive during long prompt processing (and also log
        # the progress)
        def keepalive_callback(processed, total):
            logging.info(f"Prompt processing progress: {processed}/{total}")
            if self.stream:
                msg = f": keepalive {processed}/{total}\n\n".encode()
                self.wfile.write(msg)
                self.wfile.flush()
            elif self._client_disconnected():
                raise ConnectionAbortedError("client disconnected")

        # Create the token generator
        try:
            ctx, response = self.response_generator.generate(
                request,
                args,
                progress_callback=keepalive_callback,
            )
        except Exception as e:
            status = 400 if isinstance(e, ValueError) else 404
            self._set_completion_headers(
                503 if self.response_generator._stop else status
            )
            self.end_headers()
            self.wfile.write(json.dumps({"error": str(e)}).encode())
            return

        # Prepare the headers
        if self.stream:
            self._set_stream_headers(200)
            self.end_headers()
            logging.debug("Starting stream:")
        else:
            logging.debug("Starting completion:")

        # Tool call formatter
        tool_formatter = ToolCallFormatter(ctx.tool_parser, request.tools, self.stream)

        # Initialize the text state machine
        sm_state = ctx.text_sm.make_state(ctx.initial_state)

        # Variables to save the generated text, tokens, logprobs, tools etc
        prev_state = ctx.initial_state
        finish_reason = "stop"
        reasoning_text = ""
        made_tool_call = False
        tool_text = ""
        tool_calls = []
        text = ""
        tokens = []
        token_logprobs = []
        top_tokens = []

        try:
            for gen in response:
                logging.debug(gen.text)

                # Advance the text state machine to strip control sequences
                if gen.finish_reason == "stop":
                    sm_state, current_state = TextStateMachine.discard(sm_state)
                    segments = [(current_state, "")]
                elif gen.finish_reason == "length":
                    sm_state, segments = TextStateMachine.split(sm_state, gen.text)
                    sm_state, flushed, current_state = TextStateMachine.flush(sm_state)
                    segments.append((current_state, flushed))
                else:
                    sm_state, segments = TextStateMachine.split(sm_state, gen.text)

                # Collect the clean text by state: reasoning, tool, or normal
                for current_state, clean_text in segments:
                    if current_state == "reasoning":
                        reasoning_text += clean_text
                    elif current_state == "tool":
                        tool_text += clean_text
                    elif current_state == "normal":
                        if prev_state == "tool":
                            tool_calls.append(tool_text)
                            tool_text = ""
                            made_tool_call = True
                        text += clean_text
                    prev_state = current_state

                # Add the tokens and logprobs to the vars.
                tokens.append(gen.token)
                if args.logprobs:
                    token_logprobs.append(gen.logprob)
                if args.top_logprobs > 0:
                    top_tokens.append(gen.top_tokens)

                if (
                    self.stream
                    and current_state != "tool"
                    and (text or tool_calls or reasoning_text)
                ):
                    resp = self.generate_response(
                        text,
                        None,
                        tool_calls=tool_formatter(tool_calls),
                        reasoning_text=reasoning_text,
                    )
                    self.wfile.write(f"data: {json.dumps(resp)}\n\n".encode())
                    self.wfile.flush()
                    reasoning_text = ""
                    text = ""
                    tool_calls = []

                if gen.finish_reason is not None:
                    finish_reason = gen.finish_reason

                # Nothing is written to a non-stream client before the end:
                # look whether it is still there.
                if not self.stream and self._client_disconnected():
                    raise ConnectionAbortedError("client disconnected")

            if prev_state == "tool" and tool_text:
                tool_calls.append(tool_text)
                made_tool_call = True

            if finish_reason == "stop" and made_tool_call:
                finish_reason = "tool_calls"

            if self.stream:
                resp = self.generate_response(
                    text,
                    finish_reason,
                    tool_calls=tool_formatter(tool_calls),
                    reasoning_text=reasoning_text,
                )
                self.wfile.write(f"data: {json.dumps(resp)}\n\n".encode())
                self.wfile.flush()
                if (
                    self.stream_options is not None
                    and self.stream_options["include_usage"]
                ):
                    resp = self.completion_usage_response(
                        len(ctx.prompt),
                        len(tokens),
                        ctx.prompt_cache_count,
                    )
                    self.wfile.write(f"data: {json.dumps(resp)}\n\n".encode())
                    self.wfile.flush()
                self.wfile.write("data: [DONE]\n\n".encode())
                self.wfile.flush()
            else:
                resp = self.generate_response(
                    text,
                    finish_reason,
                    len(ctx.prompt),
                    len(tokens),
                    ctx.prompt_cache_count,
                    token_logprobs=token_logprobs,
                    top_tokens=top_tokens,
                    tokens=tokens,
                    reasoning_text=reasoning_text,
                    tool_calls=tool_formatter(tool_calls),
                )
                if logging.getLogger().isEnabledFor(logging.DEBUG):
                    response_debug = json.dumps(resp, indent="\t")
                    logging.debug(f"Outgoing Response: {response_debug}")

                response_json = json.dumps(resp).encode()
                self._set_completion_headers(200)
                self.send_header("Content-Length", str(len(response_json)))
                self.end_headers()
                self.wfile.write(response_json)
                self.wfile.flush()
        except ConnectionError:
            logging.info("Request cancelled: client disconnected")
        except Exception as e:
            # The generation failed: the client gets an error, not a
            # dropped connection.
            logging.error(f"Request failed: {e!r}")
            error = json.dumps({"error": str(e)})
            if self.stream:
                self.wfile.write(f"data: {error}\n\n".encode())
                self.wfile.flush()
            else:
                self._set_completion_headers(400 if isinstance(e, ValueError) else 500)
                self.end_headers()
                self.wfile.write(error.encode())
        finally:
            ctx.stop()


PATCH = Patch(
    "server_failures",
    "server: a failing request fails alone, with an error to its client; "
    "a non-stream request whose client left is cancelled",
    targets("mlx_lm.server", select, weakref)
    + targets("mlx_lm.server:ResponseGenerator", ResponseGenerator)
    + targets("mlx_lm.server:APIHandler", APIHandler),
)
