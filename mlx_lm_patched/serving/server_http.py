"""The server takes bursts of connections and stops within its promise.

Upstream's ``ThreadingHTTPServer`` listens with the standard library's
backlog of 5: at the start of a 48-client run 3 connections were reset
(the kernel's ``ListenOverflows`` rose by 26). It starts a thread for every
connection and never times one out: 2,520 idle connections made 1,293
threads (issue 48). Here ``BoundedHTTPServer`` listens with
``--listen-backlog`` (1024), serves at most ``--max-connections`` (256)
connections at once, answering a 503 to the ones past it from the
accepting thread, and closes a connection idle for ``--idle-timeout``
seconds (60).

Stopped by SIGTERM or Ctrl-C during a batched prefill (6 prompts of 1,100
tokens on a CPU), upstream's server waited for the prefill to end (~30 s,
past a typical 30 s grace period) and then dropped every stream without an
end; a second signal gave a ``KeyboardInterrupt`` traceback from
``stop_and_join`` and exit status -2. Here the first signal closes the
listening socket (new connections are refused), ends every running request
at once with a clean end (what it has, then ``[DONE]``), answers the queued
ones and any new request on an open connection with a 503, waits at most
``STOP_SECONDS`` for the generation thread to finish its batch step and
for the handlers to write their ends, and returns to ``run``, which writes
the disk tier within its own bound. A second SIGTERM or SIGINT ends the
process at once with status 130, without a traceback.
"""

import logging
import os
import signal
import socket
import threading
import time
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING, Optional

from .._registry import Patch, edits, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    from mlx_lm.server import (
        QueueEmpty,
    )

# At most this long, once stopped, for the generation thread to end its
# batch step and for the handlers to write the ends of their requests.
STOP_SECONDS = 3.0


class BoundedHTTPServer(ThreadingHTTPServer):
    """A ``ThreadingHTTPServer`` with a listen backlog of ``backlog``, at
    most ``max_connections`` handler threads (a 503 past them) and a count
    of the requests being handled (``busy``), to wait for at a stop."""

    def __init__(self, address, handler, backlog=1024, max_connections=256):
        self.request_queue_size = backlog  # listen()'s backlog
        self.stopping = False
        self.busy = 0
        self._slots = threading.BoundedSemaphore(max_connections)
        self._idle = threading.Condition()
        super().__init__(address, handler)

    def process_request(self, request, client_address):
        if self.stopping or not self._slots.acquire(blocking=False):
            self._refuse(request)
            return
        try:
            super().process_request(request, client_address)
        except Exception:
            self._slots.release()
            raise

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def _refuse(self, request):
        """Answer 503 in the accepting thread, reading what the client sent
        first (a close with unread bytes resets the connection, and the
        client may lose the answer)."""
        body = b'{"error": "Server busy: too many connections"}'
        if self.stopping:
            body = b'{"error": "Server is stopping"}'
        try:
            request.settimeout(0.05)
            try:
                request.recv(65536)
            except OSError:
                pass
            request.sendall(
                b"HTTP/1.1 503 Service Unavailable\r\n"
                b"Content-Type: application/json\r\nConnection: close\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )
            request.shutdown(socket.SHUT_WR)
            request.recv(65536)
        except OSError:
            pass
        self.shutdown_request(request)

    def request_started(self):
        with self._idle:
            self.busy += 1

    def request_done(self):
        with self._idle:
            self.busy -= 1
            self._idle.notify_all()

    def wait_idle(self, timeout):
        """Wait at most ``timeout`` s for no request to be handled."""
        with self._idle:
            return self._idle.wait_for(lambda: self.busy <= 0, timeout)

    @staticmethod
    def exit_at_once(signum, frame):
        """A second SIGINT or SIGTERM: no drain, no traceback."""
        os.write(2, b"Stopped at once by a second signal\n")
        os._exit(130)

    def serve_until_stopped(self, response_generator):
        """``serve_forever`` until SIGINT or SIGTERM, then stop as the module
        says."""
        try:
            signal.signal(signal.SIGTERM, signal.default_int_handler)
        except ValueError:  # not on the main thread: no signals here
            pass
        try:
            self.serve_forever()
        except KeyboardInterrupt:
            try:
                for s in (signal.SIGINT, signal.SIGTERM):
                    signal.signal(s, self.exit_at_once)
            except ValueError:
                pass
            start = time.perf_counter()
            logging.info("Stopping: no new connections; ending the running requests")
            self.stopping = True
            self.server_close()  # the listening socket: connections are refused
            response_generator.stop_and_join(timeout=STOP_SECONDS)
            left = STOP_SECONDS - (time.perf_counter() - start)
            if not self.wait_idle(max(left, 0.5)):
                logging.warning(f"Stopping: {self.busy} requests still writing")
            logging.info(f"Stopped in {time.perf_counter() - start:.2f} s")


# Written as they read in mlx_lm/server.py, and run there.
class ResponseGenerator:
    def stop_and_join(self, timeout: Optional[float] = None):
        """Stop the generation thread, waiting at most ``timeout`` s for it;
        every request it took ends with what it has, the queued ones fail."""
        self._stop = True
        for rqueue in list(getattr(self, "_taken", ())):  # server_failures
            rqueue.put(None)
        self._generation_thread.join(timeout)
        if self._generation_thread.is_alive():
            logging.warning(f"Generation thread still busy after {timeout} s")
        for rqueue in list(getattr(self, "_taken", ())):
            rqueue.put(None)
        while True:
            try:
                rqueue = self.requests.get_nowait()[0]
            except QueueEmpty:
                break
            rqueue.put(RuntimeError("Server is stopping"))


# ResponseGenerator._generate: a stopped server ends its batch at the next step.
_GENERATE = """\
@@ -197,2 +197,4 @@
             for _ in self._time_budget:
+                if self._stop:  # server_http: stopped at the next step
+                    break
                 prompt_responses, gen_responses = batch_generator.next()
"""


# ResponseGenerator.generate: a stopping server takes no request.
_RG_GENERATE = """\
@@ -4,5 +4,7 @@
     generation_args: GenerationArguments,
-    progress_callback: Optional[Callable[[int, int], None]] = None,
+    progress_callback=None,
 ):
     response_queue = Queue()
+    if self._stop:
+        raise RuntimeError("Server is stopping")
     if not self.generation_available():
@@ -25,2 +27,4 @@
     ctx = self._await_response(response_queue)
+    if ctx is None:  # stopped before it started
+        raise RuntimeError("Server is stopping")
     if isinstance(ctx, Exception):
"""


# _run_http_server: a bounded server, stopped by SIGTERM.
_RUN_HTTP_SERVER = """\
@@ -4,5 +4,6 @@
     response_generator,
-    server_class=ThreadingHTTPServer,
+    server_class=None,
     handler_class=APIHandler,
 ):
+    server_class = server_class or BoundedHTTPServer  # or a subclass of it
     server_address = (host, port)
@@ -12,5 +13,36 @@
     server_class.address_family, _, _, _, server_address = next(iter(infos))
+    cli_args = response_generator.cli_args
+
+    class Handler(handler_class):
+        # Idle connections are closed after this many seconds.
+        timeout = getattr(cli_args, "idle_timeout", 60.0)
+
+        def parse_request(self):
+            # A request read while stopping gets a 503; the others are counted.
+            if not BaseHTTPRequestHandler.parse_request(self):
+                return False
+            if not self.server.stopping:
+                self.server.request_started()
+                self._counted = True
+                return True
+            self.close_connection = True
+            self._set_completion_headers(503)
+            self.send_header("Connection", "close")
+            self.end_headers()
+            self.wfile.write(b'{"error": "Server is stopping"}')
+            return False
+
+        def handle_one_request(self):
+            self._counted = False
+            try:
+                BaseHTTPRequestHandler.handle_one_request(self)
+            finally:
+                if self._counted:
+                    self.server.request_done()
+                if self.server.stopping:
+                    self.close_connection = True
+
     httpd = server_class(
         server_address,
-        lambda *args, **kwargs: handler_class(
+        lambda *args, **kwargs: Handler(
             response_generator,
@@ -20,2 +52,4 @@
         ),
+        backlog=getattr(cli_args, "listen_backlog", 1024),
+        max_connections=getattr(cli_args, "max_connections", 256),
     )
@@ -26,6 +60,2 @@
     logging.info(f"Starting httpd at {host} on port {port}...")
-    try:
-        httpd.serve_forever()
-    except KeyboardInterrupt:
-        httpd.shutdown()
-        response_generator.stop_and_join()
+    httpd.serve_until_stopped(response_generator)
"""


PATCH = Patch(
    "server_http",
    "server: a listen backlog, bounded handler threads (503 past them) and "
    "idle timeouts; SIGTERM and Ctrl-C end running requests cleanly and stop "
    "within STOP_SECONDS, a second signal at once",
    targets(
        "mlx_lm.server",
        os,
        signal,
        threading,
        BoundedHTTPServer,
        STOP_SECONDS=STOP_SECONDS,
    )
    + edits("mlx_lm.server", _run_http_server=_RUN_HTTP_SERVER)
    + targets("mlx_lm.server:ResponseGenerator", ResponseGenerator)
    + edits(
        "mlx_lm.server:ResponseGenerator", generate=_RG_GENERATE, _generate=_GENERATE
    ),
)
