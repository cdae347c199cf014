"""The OpenAI-compatible HTTP server (`minivllm serve`)."""
from minivllm.server.api import build_app, serve
from minivllm.server.serving import ServerOptions

__all__ = ["ServerOptions", "build_app", "serve"]
