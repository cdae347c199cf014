"""The OpenAI-compatible HTTP server (`minivllm serve`)."""
from minivllm.server.api import ServerOptions, build_app, serve

__all__ = ["ServerOptions", "build_app", "serve"]
