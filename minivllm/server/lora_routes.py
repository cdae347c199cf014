"""The server's LoRA side, as vLLM's: adapters named at start (`--lora-modules name=path`) or loaded
at runtime (POST /v1/load_lora_adapter {"lora_name", "lora_path"}, POST /v1/unload_lora_adapter
{"lora_name"}), listed by /v1/models with the base as their `parent`, and picked by a request's
`model` field. The engine does the loading and checking (LLMEngine.add_lora / remove_lora); this
file keeps the names it may resolve a request's model to without asking the engine.
"""
from __future__ import annotations

import itertools
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, ValidationError

from minivllm.lora.request import LoRARequest


class _LoadBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str


class _UnloadBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str


def parse_lora_modules(values: list[str]) -> list[LoRARequest]:
    """`--lora-modules` values, `name=path` or vLLM's JSON `{"name": ..., "path": ...}`, with ids 1, 2, ..."""
    requests = []
    for i, value in enumerate(values, start=1):
        if value.lstrip().startswith("{"):
            try:
                spec = json.loads(value)
                name, path = spec["name"], spec["path"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules {value!r}: expected name=path or "
                                 f'{{"name": ..., "path": ...}} ({e})') from None
        else:
            name, sep, path = value.partition("=")
            if not sep or not name or not path:
                raise ValueError(f"--lora-modules {value!r}: expected name=path")
        requests.append(LoRARequest(name, i, path))
    return requests


class LoRARoutes:
    """`engine` is the server's AsyncEngine: `utility(method, *args)` runs an LLMEngine method in its
    step thread."""

    def __init__(self, engine: Any, base_model: str, adapters: list[LoRARequest], error: type[Exception]) -> None:
        self.engine, self.base_model, self.error = engine, base_model, error
        self.adapters = {r.lora_name: r for r in adapters}
        self._ids = itertools.count(max((r.lora_int_id for r in adapters), default=0) + 1)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base); an unknown name is a 404."""
        if model is None or model == self.base_model:
            return None
        adapter = self.adapters.get(model)
        if adapter is None:
            served = ", ".join(f"`{m}`" for m in [self.base_model, *self.adapters])
            raise self.error(404, f"The model `{model}` does not exist; this server serves {served}", "model",
                             "model_not_found")
        return adapter

    def model_cards(self, created: int) -> list[dict[str, Any]]:
        return [{"id": name, "object": "model", "created": created, "owned_by": "minivllm", "root": r.lora_path,
                 "parent": self.base_model} for name, r in self.adapters.items()]

    async def load(self, request: Request) -> Response:
        body = self._parse(_LoadBody, await request.body())
        if body.lora_name in self.adapters or body.lora_name == self.base_model:
            raise self.error(400, f"The lora adapter '{body.lora_name}' has already been loaded.", "lora_name")
        lora = LoRARequest(body.lora_name, next(self._ids), body.lora_path)
        try:
            await self.engine.utility("add_lora", lora)
        except ValueError as e:  # the adapter's problem, named by the engine
            raise self.error(400, str(e), "lora_path", "invalid_lora_adapter") from None
        self.adapters[lora.lora_name] = lora
        return Response(f"Success: LoRA adapter '{lora.lora_name}' added successfully.", media_type="text/plain")

    async def unload(self, request: Request) -> Response:
        body = self._parse(_UnloadBody, await request.body())
        if self.adapters.pop(body.lora_name, None) is None:
            raise self.error(404, f"The lora adapter '{body.lora_name}' cannot be found.", "lora_name",
                             "model_not_found")
        await self.engine.utility("remove_lora", body.lora_name)
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    def _parse(self, model: type[BaseModel], body: bytes) -> Any:
        try:
            return model.model_validate_json(body)
        except ValidationError as e:
            problem = e.errors()[0]
            field = ".".join(map(str, problem["loc"])) or None
            raise self.error(400, f"{field or 'body'}: {problem['msg']}", field) from None


def add_lora_routes(app: FastAPI, routes: LoRARoutes, dependencies: list) -> None:
    app.post("/v1/load_lora_adapter", dependencies=dependencies)(routes.load)
    app.post("/v1/unload_lora_adapter", dependencies=dependencies)(routes.unload)
