"""``GET /v1/models`` without a Hugging Face hub cache answers, quietly.

Upstream's ``handle_models_request`` sends its 200 headers, then scans the
hub cache: on a machine without one (a server of local models, a fresh
container) ``scan_cache_dir`` raises ``CacheNotFound``, the log shows its
traceback on every request and the client gets a 200 with no body. Here no
hub cache is an empty one: the reply lists the local ``--model``, and the
log has no traceback.
"""

from typing import TYPE_CHECKING

from .._registry import Patch, targets

if TYPE_CHECKING:  # names the code below finds in the upstream module it runs in
    import json

    from mlx_lm.server import Path, scan_cache_dir


# Written as it reads in mlx_lm/server.py, and runs there.
class APIHandler:
    def handle_models_request(self):
        """
        Handle a GET request for the /v1/models endpoint.
        """
        self._set_completion_headers(200)
        self.end_headers()

        files = ["config.json", "model.safetensors.index.json", "tokenizer_config.json"]

        parts = self.path.split("/")
        filter_repo_id = None
        if len(parts) > 3:
            filter_repo_id = "/".join(parts[3:])

        def probably_mlx_lm(repo):
            if repo.repo_type != "model":
                return False
            if "main" not in repo.refs:
                return False
            if filter_repo_id is not None and repo.repo_id != filter_repo_id:
                return False
            file_names = {f.file_path.name for f in repo.refs["main"].files}
            return all(f in file_names for f in files)

        # Scan the cache directory for downloaded mlx models (none without one)
        from huggingface_hub.errors import CacheNotFound

        try:
            repos = scan_cache_dir().repos
        except CacheNotFound:
            repos = ()
        downloaded_models = [repo for repo in repos if probably_mlx_lm(repo)]

        # Create a list of available models
        models = [
            {
                "id": repo.repo_id,
                "object": "model",
                "created": self.created,
            }
            for repo in downloaded_models
        ]

        if self.response_generator.cli_args.model:
            model_path = Path(self.response_generator.cli_args.model)
            if model_path.exists():
                model_id = str(model_path.resolve())
                models.append(
                    {
                        "id": model_id,
                        "object": "model",
                        "created": self.created,
                    }
                )

        response = {"object": "list", "data": models}

        response_json = json.dumps(response).encode()
        self.wfile.write(response_json)
        self.wfile.flush()


PATCH = Patch(
    "server_models",
    "server: GET /v1/models without a hub cache lists the local model, no traceback",
    targets("mlx_lm.server:APIHandler", APIHandler),
)
