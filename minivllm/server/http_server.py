"""The uvicorn server that `minivllm serve` and `minivllm view` run (the router runs its own)."""
from __future__ import annotations

import uvicorn

from minivllm.startup import phases_text, process_age


def listening_url(server: uvicorn.Server) -> str:
    """The address a started server listens on (the real port, with --port 0)."""
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class HTTPServer(uvicorn.Server):
    """uvicorn's server, saying where it listens and how long the start took once the port is bound, and
    closing the dashboard's event streams (which never end by themselves) when it shuts down."""

    def __init__(self, config: uvicorn.Config, model_name: str, startup_time: dict[str, float] | None = None) -> None:
        super().__init__(config)
        self.model_name = model_name
        self.startup_time = startup_time or {}  # the engine's start-up phases, reported once ready

    async def startup(self, sockets: list | None = None) -> None:
        await super().startup(sockets)
        if self.started:  # the port is bound: now the address (and the real port, with --port 0) is known
            print(f"minivllm: serving {self.model_name} on {listening_url(self)}", flush=True)
            self._print_ready()

    def _print_ready(self) -> None:
        phases = dict(self.startup_time)
        total = process_age()
        if total is not None and "import" in phases:  # what is left is the server's own start
            phases["server"] = max(0.0, total - sum(phases.values()))
        else:
            total = sum(phases.values())
        print(f"minivllm: ready in {total:.2f} s ({phases_text(phases)})", flush=True)

    async def shutdown(self, sockets: list | None = None) -> None:
        self.config.app.state.dashboard.close()  # its event streams never end by themselves
        await super().shutdown(sockets)
