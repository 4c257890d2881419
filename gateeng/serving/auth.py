"""The API key (`gateeng serve --api-key`): what each front asks of a call before it
serves it.

Protected: every gateeng.v1.Engine RPC (metadata `authorization: Bearer <key>`), and
every HTTP path of the OpenAI front but /health and /metrics (header `Authorization:
Bearer <key>`), unknown paths included, so a route added later is protected too.
Open: gRPC health and reflection, /health, /metrics and the --metrics-port
listener, so that probes and scrapers need no key. A call without the key, or with
another, is refused UNAUTHENTICATED (HTTP 401 with `WWW-Authenticate: Bearer`, in
OpenAI's error shape) before any of it is read, and counted like any refusal. Keys
are compared in constant time and never logged or echoed.

A call may carry several `authorization` entries: the admin RPCs take the admin
token in one and, where a key is set, the key in another (grpc_api.py).
"""
from __future__ import annotations

import hmac
from typing import Callable, Iterable, Optional

import grpc

from gateeng.serving.refusals import Kind, Refusal

OPEN_HTTP_PATHS = frozenset({"/health", "/metrics"})
HTTP_HOW = "send the header `Authorization: Bearer <key>`"
GRPC_HOW = "send the metadata `authorization: Bearer <key>`"


def bearer_matches(values: Iterable, secret: str) -> bool:
    """Whether one of the `authorization` values (str or bytes) is `Bearer <secret>`;
    the scheme's case is free (RFC 7235). Each is compared in constant time."""
    want, found = secret.encode(), False
    for value in values:
        raw = value if isinstance(value, bytes) else value.encode(errors="replace")
        scheme, _, token = raw.strip().partition(b" ")
        found |= scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), want)
    return found


def refusal(values: Iterable, key: str, how: str) -> Optional[Refusal]:
    """None where the `authorization` values carry `key`, else the refusal to answer."""
    values = list(values)
    if not values:
        return Refusal(Kind.UNAUTHENTICATED, f"no API key: this server needs one; {how}", code="invalid_api_key")
    if not bearer_matches(values, key):
        return Refusal(Kind.UNAUTHENTICATED, f"incorrect API key; {how}", code="invalid_api_key")
    return None


class GrpcApiKey(grpc.aio.ServerInterceptor):
    """Refuses every call to `service` that lacks the key; other services (health,
    reflection) pass untouched. `refused` counts each refusal."""

    def __init__(self, key: str, service: str, refused: Callable[[Refusal], None]):
        self.key, self.prefix, self.refused = key, f"/{service}/", refused

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self.prefix):
            return handler
        found = refusal((v for k, v in details.invocation_metadata or () if k == "authorization"), self.key,
                        GRPC_HOW)
        if found is None:
            return handler
        self.refused(found)

        async def refuse(request, context):
            await context.abort(found.kind.grpc_code, found.message)
        # The same arity as the method's own handler, so the call ends as its client expects.
        make = grpc.unary_stream_rpc_method_handler if handler.response_streaming \
            else grpc.unary_unary_rpc_method_handler
        return make(refuse, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


class HttpApiKey:
    """ASGI middleware over the OpenAI front: every HTTP path but OPEN_HTTP_PATHS needs
    the key. A refusal is answered at once, its body unread, and the connection
    closed (its unread body cannot be skipped on a kept-alive connection)."""

    def __init__(self, app, key: str, refused: Callable[[Refusal], None]):
        from gateeng.serving.http_api import error_response   # loaded only where HTTP is served
        self.app, self.key, self.refused, self.error_response = app, key, refused, error_response

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_HTTP_PATHS:
            found = refusal((v for k, v in scope["headers"] if k == b"authorization"), self.key, HTTP_HOW)
            if found is not None:
                self.refused(found)
                response = self.error_response(found)
                response.headers["WWW-Authenticate"] = "Bearer"
                response.headers["Connection"] = "close"
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
