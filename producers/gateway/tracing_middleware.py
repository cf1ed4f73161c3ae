"""The gateway's SERVER span of each HTTP request, when tracing is on (``fleet.tracing``): a pure ASGI middleware
that ``create_app`` installs only then, so a gateway with tracing off runs none of it.

A client's ``traceparent`` / ``tracestate`` headers make the span a child of the client's trace; everything the
request does (a job's publish, a DAG run's start) is a child of it. The span is named ``<method> <route>`` once
routing has matched (the route's template, e.g. ``POST /v1/jobs``), and carries the response status.
"""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fleet.producers.gateway.metrics import route_label


class TracingMiddleware:
    """Pure ASGI middleware: one SERVER span per HTTP request (WebSockets pass through untraced)."""

    def __init__(self, app: ASGIApp, tracing: Any) -> None:
        self.app = app
        self.tracing = tracing

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        method = str(scope.get("method", ""))
        with self.tracing.server(method, str(scope.get("path", "")), headers) as span:

            async def send_wrapper(message: Message) -> None:
                if message["type"] == "http.response.start":
                    span.set_attribute("http.response.status_code", int(message["status"]))
                await send(message)

            try:
                await self.app(scope, receive, send_wrapper)
            finally:
                route = route_label(scope)
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)
