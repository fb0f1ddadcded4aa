"""/health answers 503 until the default model is loaded and warmed up.

Upstream's ``/health`` is 200 as long as the generation thread lives, and
the HTTP server starts before that thread loads the model: a load
balancer, an orchestrator's readiness probe or a client that waits for
``/health`` sends its first request to a server that then loads the model
(7-9 s for Llama-3-8B's 16 GB on an H200) before the request's first
token. Here ``is_healthy`` is also false until ``_generate`` has loaded
the default model and served the warm-up (``server_warmup``): 503
``{"status": "unavailable"}`` meanwhile, as upstream answers for a dead
thread. Requests sent early still queue and are served as before.
"""

from .._registry import Patch, edits, targets


# Written as it reads in mlx_lm/server.py, and runs there.
class ResponseGenerator:
    _ready = False  # the default model loaded and warmed up (_generate)

    @property
    def is_healthy(self):
        return self.generation_available() and self._ready


# ResponseGenerator._generate: ready once loaded and warmed up.
_GENERATE = """\
@@ -8,2 +8,3 @@
     self.model_provider.load_default()
     self._warm_up(generation_stream)
+    self._ready = True
"""


PATCH = Patch(
    "server_readiness",
    "server: /health answers 503 until the default model is loaded and "
    "warmed up, so that a first request does not wait for the load",
    targets("mlx_lm.server:ResponseGenerator", ResponseGenerator)
    + edits("mlx_lm.server:ResponseGenerator", _generate=_GENERATE),
    requires=("server_warmup",),
)
