"""The dashboard: a page that draws the scheduler's step loop, live (`minivllm serve`) or replayed from
trace files (`minivllm view`).

    GET  /, /dashboard           the page (static/dashboard.html, .js, .css: no CDN, no build step)
    GET  /dashboard/info         what the page shows: live, or the names of the traces it replays
    GET  /dashboard/stream       live: server-sent events, each a batch of the feed's records
    GET  /dashboard/traces       replay: every record of every trace
    POST /dashboard/login        with --api-key: the key, once, from the page's form; answers with a cookie

The records are those of tracing/trace.py: a "run" record (the budgets), one "step" record per engine
step (the step trace's CSV row) and one "request" record per state change of a request.

With --api-key, every dashboard route needs the key like /v1 does. A browser's EventSource cannot
send an Authorization header, so the page takes the key once (a form, or ?api_key= in the address)
and the server hands back an HttpOnly cookie that carries a hash of it; the header also works.
"""
from __future__ import annotations

import asyncio
import csv
import hashlib
import json
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.sse import KEEPALIVE_COMMENT, EventSourceResponse, format_sse_event

from minivllm.tracing.live import LiveFeed
from minivllm.tracing.trace import COLUMNS, REQUIRED_COLUMNS

POLL_S = 0.1  # how often a stream looks for new records: the page redraws at about this rate
PING_S = 2.0  # an idle stream says it is alive (to proxies, and to readers waiting for a condition)
WINDOW_S = 60.0  # the page shows the last minute
COOKIE = "minivllm_dashboard"
STATIC = resources.files("minivllm.server") / "static"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}

LOGIN_PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>minivllm dashboard</title></head>
<body style="font-family: sans-serif; margin: 3em">
<h1>minivllm dashboard</h1><p>This server was started with <code>--api-key</code>: enter the key once.</p>
<form method="post" action="/dashboard/login"><input type="password" name="api_key" autofocus size="40">
<button>Open</button></form><p style="color: #b00">{error}</p></body></html>"""


@dataclass
class Trace:
    name: str
    records: list[dict[str, Any]]


def load_trace(path: str | Path) -> Trace:
    """A trace written by `--trace-file` (or `bench compare`): the records file (.jsonl) beside the
    path given (steps.csv, steps.json or steps.jsonl); a CSV alone gives the per-step charts only."""
    path = Path(path)
    records_path, csv_path = path.with_suffix(".jsonl"), path.with_suffix(".csv")
    if records_path.exists():
        with open(records_path) as f:
            records = [json.loads(line) for line in f if line.strip()]
    elif csv_path.exists():
        with open(csv_path) as f:
            records = [{"kind": "step", **{k: float(v) for k, v in row.items()}} for row in csv.DictReader(f)]
        if records and not REQUIRED_COLUMNS <= set(records[0]) - {"kind"} <= set(COLUMNS):
            raise ValueError(f"{csv_path}: not a step trace (the columns are {', '.join(COLUMNS)})")
    else:
        raise ValueError(f"{path}: no trace there (looked for {records_path.name} and {csv_path.name})")
    return Trace(path.stem, records)


class Dashboard:
    def __init__(self, api_key: str | None, feed: LiveFeed | None = None, traces: list[Trace] | None = None,
                 title: str = "minivllm") -> None:
        self.api_key, self.feed, self.traces, self.title = api_key, feed, traces, title
        self._token = hashlib.sha256(b"minivllm-dashboard\0" + api_key.encode()).hexdigest() if api_key else None
        self.closed = False

    def close(self) -> None:
        """End the event streams, which would otherwise hold a graceful shutdown up until its timeout."""
        self.closed = True

    # -- authentication ------------------------------------------------------------------------------------
    def authorized(self, request: Request) -> bool:
        if self.api_key is None:
            return True
        auth = request.headers.get("authorization", "")
        given = [(auth.removeprefix("Bearer "), self.api_key), (request.query_params.get("api_key", ""), self.api_key),
                 (request.cookies.get(COOKIE, ""), self._token)]
        return any(value and secrets.compare_digest(value.encode(), expected.encode()) for value, expected in given)

    def _login(self, status: int, error: str = "") -> HTMLResponse:
        return HTMLResponse(LOGIN_PAGE.format(error=error), status_code=status)

    def _with_cookie(self, response: Response) -> Response:
        if self._token:
            response.set_cookie(COOKIE, self._token, httponly=True, samesite="strict", path="/")
        return response

    # -- endpoints ---------------------------------------------------------------------------------------------
    async def page(self, request: Request) -> Response:
        if not self.authorized(request):
            return self._login(401)
        if "api_key" in request.query_params:  # keep the key out of the address bar and the history
            return self._with_cookie(RedirectResponse("/dashboard", status_code=303))
        return HTMLResponse((STATIC / "dashboard.html").read_text())

    async def login(self, request: Request) -> Response:
        key = parse_qs((await request.body()).decode(errors="replace")).get("api_key", [""])[0]
        if self.api_key is None or secrets.compare_digest(key.encode(), self.api_key.encode()):
            return self._with_cookie(RedirectResponse("/dashboard", status_code=303))
        return self._login(401, "incorrect API key")

    async def asset(self, request: Request, name: str) -> Response:
        if not self.authorized(request):
            return _unauthorized()
        if name not in ASSETS:
            return JSONResponse({"error": {"message": f"no asset {name!r}"}}, status_code=404)
        return Response((STATIC / name).read_text(), media_type=ASSETS[name])

    async def info(self, request: Request) -> Response:
        if not self.authorized(request):
            return _unauthorized()
        info = {"mode": "replay", "title": self.title, "window_s": WINDOW_S,
                "traces": [t.name for t in self.traces or []]}
        if self.feed is not None:
            info.update(mode="live", records_held=len(self.feed), records_capacity=self.feed.capacity)
        return JSONResponse(info)

    async def traces_endpoint(self, request: Request) -> Response:
        if not self.authorized(request):
            return _unauthorized()
        return JSONResponse([{"name": t.name, "records": t.records} for t in self.traces or []])

    async def stream(self, request: Request) -> Response:
        if not self.authorized(request):
            return _unauthorized()
        if self.feed is None:
            return JSONResponse({"error": {"message": "this dashboard replays traces: no live stream"}},
                                status_code=404)
        return EventSourceResponse(self._events(self.feed))

    async def _events(self, feed: LiveFeed) -> AsyncIterator[bytes]:
        """The run record, what the ring still holds (about the last minute), then new records as they
        come. A reader that stops reading blocks only this generator (on its socket), never the engine."""
        yield format_sse_event(data_str=json.dumps({"records": [feed.run], "missed": 0}))
        seq, idle = feed.oldest_seq, 0.0
        while not self.closed:
            batch = feed.since(seq)
            if batch.records or batch.missed:
                yield format_sse_event(data_str=json.dumps({"records": batch.records, "missed": batch.missed}))
                seq, idle = batch.next_seq, 0.0
            elif idle >= PING_S:
                yield KEEPALIVE_COMMENT
                idle = 0.0
            else:
                await asyncio.sleep(POLL_S)
                idle += POLL_S


def _unauthorized() -> JSONResponse:
    return JSONResponse({"error": {"message": "missing or incorrect API key: open /dashboard to enter it",
                                   "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}},
                        status_code=401)


def add_routes(app: FastAPI, dashboard: Dashboard) -> None:
    app.state.dashboard = dashboard  # the server closes it when it shuts down
    app.get("/", include_in_schema=False)(lambda: RedirectResponse("/dashboard"))
    app.get("/dashboard")(dashboard.page)
    app.post("/dashboard/login")(dashboard.login)
    app.get("/dashboard/info")(dashboard.info)
    app.get("/dashboard/stream")(dashboard.stream)
    app.get("/dashboard/traces")(dashboard.traces_endpoint)
    app.get("/dashboard/static/{name}")(dashboard.asset)


def build_view_app(paths: list[str]) -> FastAPI:
    """The page replaying trace files, side by side (`minivllm view`)."""
    traces = [load_trace(p) for p in paths]
    app = FastAPI(title="minivllm view")
    add_routes(app, Dashboard(None, traces=traces, title=" vs ".join(t.name for t in traces)))
    return app


def view(paths: list[str], host: str = "127.0.0.1", port: int = 8000) -> None:
    import uvicorn

    from minivllm.server.http_server import HTTPServer

    HTTPServer(uvicorn.Config(build_view_app(paths), host=host, port=port), "a replay of " + ", ".join(paths)).run()
