"""``GET /v1/models`` without a Hugging Face hub cache answers, quietly.

Upstream's ``handle_models_request`` sends its 200 headers, then scans the
hub cache: on a machine without one (a server of local models, a fresh
container) ``scan_cache_dir`` raises ``CacheNotFound``, the log shows its
traceback on every request and the client gets a 200 with no body. Here no
hub cache is an empty one: the reply lists the local ``--model``, and the
log has no traceback.
"""

from .._registry import Patch, edits

# APIHandler.handle_models_request: no hub cache needed.
_HANDLE_MODELS_REQUEST = """\
@@ -24,7 +24,10 @@
 
-    # Scan the cache directory for downloaded mlx models
-    hf_cache_info = scan_cache_dir()
-    downloaded_models = [
-        repo for repo in hf_cache_info.repos if probably_mlx_lm(repo)
-    ]
+    # Scan the cache directory for downloaded mlx models (none without one)
+    from huggingface_hub.errors import CacheNotFound
 
+    try:
+        repos = scan_cache_dir().repos
+    except CacheNotFound:
+        repos = ()
+    downloaded_models = [repo for repo in repos if probably_mlx_lm(repo)]
+
"""


PATCH = Patch(
    "server_models",
    "server: GET /v1/models without a hub cache lists the local model, no traceback",
    edits("mlx_lm.server:APIHandler", handle_models_request=_HANDLE_MODELS_REQUEST),
)
