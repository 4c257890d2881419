"""One refusal taxonomy for both fronts: why a request is refused or cut, and what
each front answers for it (the gRPC status, the HTTP status and OpenAI's error
type, a retry hint). Anything the fronts refuse is a Refusal; an engine error
becomes one through `from_engine`.
"""
from __future__ import annotations

import enum
from typing import Optional

import grpc

from gateeng.engine.errors import DeterminismUnavailable, EngineDead, QueueFull, WeightUpdateUnavailable

RETRY_AFTER_S = 1   # the back-off a busy server asks for (gRPC pushback, HTTP Retry-After)


class Kind(enum.Enum):
    """(gRPC status, HTTP status, OpenAI error type) per kind of refusal."""
    INVALID = (grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request_error")
    TOO_LARGE = (grpc.StatusCode.INVALID_ARGUMENT, 413, "invalid_request_error")
    TIMEOUT = (grpc.StatusCode.DEADLINE_EXCEEDED, 408, "invalid_request_error")
    NOT_FOUND = (grpc.StatusCode.NOT_FOUND, 404, "not_found_error")
    IN_FLIGHT = (grpc.StatusCode.ALREADY_EXISTS, 409, "invalid_request_error")
    BUSY = (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_error")
    NO_VERIFIED = (grpc.StatusCode.FAILED_PRECONDITION, 400, "invalid_request_error")
    NOT_HERE = (grpc.StatusCode.FAILED_PRECONDITION, 409, "invalid_request_error")   # not on this server's setup
    UNAUTHENTICATED = (grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_request_error")   # OpenAI's, for a bad key
    DENIED = (grpc.StatusCode.PERMISSION_DENIED, 403, "permission_error")
    UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, 503, "server_error")
    INTERNAL = (grpc.StatusCode.INTERNAL, 500, "server_error")

    @property
    def grpc_code(self) -> grpc.StatusCode:
        return self.value[0]

    @property
    def http_status(self) -> int:
        return self.value[1]

    @property
    def openai_type(self) -> str:
        return self.value[2]


class Refusal(Exception):
    """A request refused (or cut) with a message a person can act on. `param` names
    the field at fault; `retry_after_s` is set where retrying later helps."""

    def __init__(self, kind: Kind, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 retry_after_s: Optional[int] = None):
        super().__init__(message)
        self.kind, self.message, self.param, self.code, self.retry_after_s = kind, message, param, code, retry_after_s


def busy(message: str) -> Refusal:
    return Refusal(Kind.BUSY, f"{message}; retry in about {RETRY_AFTER_S} s", retry_after_s=RETRY_AFTER_S)


def internal_error(request_id: str) -> Refusal:
    """What a client is told when serving its request raised unexpectedly (the
    server log has the traceback under the same id)."""
    return Refusal(Kind.INTERNAL, f"internal error serving request {request_id}; the server log has the details")


def from_engine(exc: Exception, submitted: bool = False) -> Refusal:
    """The refusal for what EngineCore / Engine raised: at submission, or (submitted)
    while the request ran. Other exceptions are not refusals: they propagate."""
    if isinstance(exc, Refusal):
        return exc
    if isinstance(exc, EngineDead):
        if submitted:
            return Refusal(Kind.INTERNAL, str(exc))
        return Refusal(Kind.UNAVAILABLE, f"{exc}; retry on another replica")
    if isinstance(exc, QueueFull):
        return busy(str(exc))
    if isinstance(exc, DeterminismUnavailable):
        return Refusal(Kind.NO_VERIFIED, str(exc), param="determinism")
    if isinstance(exc, WeightUpdateUnavailable):
        return Refusal(Kind.NOT_HERE, str(exc))
    if isinstance(exc, ValueError):   # checks.BadRequest included
        return Refusal(Kind.INVALID, str(exc), param=getattr(exc, "param", None), code=getattr(exc, "code", None))
    raise exc
