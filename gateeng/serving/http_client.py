"""A client of the OpenAI-compatible HTTP front, for the tools (`gateeng replay`,
`gateeng probe`): JSON in and out over the standard library, with the API key as a
bearer token and, for HTTPS, a CA file to trust. It speaks to any OpenAI-compatible
server and imports nothing of gateeng's own server."""
from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from typing import Optional


class HttpError(ValueError):
    """The server answered with an HTTP error: its status and its message."""

    def __init__(self, code: int, message: str):
        super().__init__(f"HTTP {code}: {message}")
        self.code, self.message = code, message


def openai_base(url: str) -> str:
    """The API root: `http://host:port` and `http://host:port/v1` both name it."""
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def http_json(url: str, body: Optional[dict] = None, timeout: float = 3600, api_key: Optional[str] = None,
              ca_file: Optional[str] = None):
    """GET (body None) or POST JSON, with `Authorization: Bearer <api_key>` where a key
    is given; `ca_file` is the CA an HTTPS server's certificate must chain to (default:
    the system's). An HTTP error raises HttpError with the server's message (OpenAI's
    error shape read where the body has it)."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(url, data=data, headers=headers)
    context = ssl.create_default_context(cafile=ca_file) if ca_file else None
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        detail = e.read().decode(errors="replace")
        try:
            detail = json.loads(detail)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            pass
        raise HttpError(e.code, detail) from None
