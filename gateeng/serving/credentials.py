"""Where the server's secrets come from, for the server and our clients alike: the
environment variables they read, and reading a secret from a file.

A secret here is an API key or the admin token. Either travels as `Bearer <secret>`
in an HTTP header or gRPC metadata, so it must be printable ASCII without spaces:
anything else would be changed on the way, or refused by the client library, and
never match. Light on purpose (no grpc): the command line imports it for every
command.
"""
from __future__ import annotations

import os
import stat
from typing import Optional

from gateeng.logs import LOGGER

ADMIN_TOKEN_ENV = "GATEENG_ADMIN_TOKEN"
API_KEY_ENV = "GATEENG_API_KEY"
# Our clients' TLS files, where a flag does not name them: a container's HEALTHCHECK
# cannot pass flags the operator chose later, but the operator can set these.
CA_FILE_ENV = "GATEENG_CA_FILE"
CLIENT_CERT_ENV = "GATEENG_CLIENT_CERT"
CLIENT_KEY_ENV = "GATEENG_CLIENT_KEY"

log = LOGGER.getChild("credentials")


def checked(secret: str, where: str) -> str:
    """`secret` itself, or a ValueError naming `where` it came from (never the secret)."""
    if not secret:
        raise ValueError(f"{where} is empty")
    bad = next((c for c in secret if not 33 <= ord(c) <= 126), None)
    if bad is not None:
        raise ValueError(f"{where} holds {'a space' if bad == ' ' else 'a control or non-ASCII character'}: a "
                         f"secret is sent as `Bearer <secret>` in a header, so it must be printable ASCII "
                         f"without spaces")
    return secret


def read_secret_file(path: str, flag: str) -> str:
    """The secret in the file at `path` (given with `flag`): its text less one trailing
    newline, checked. A file that other users can read is served all the same, with
    a warning."""
    with open(path) as f:
        text, mode = f.read(), os.fstat(f.fileno()).st_mode
    if mode & (stat.S_IRGRP | stat.S_IROTH):
        log.warning("%s %s can be read by other users (mode %03o): `chmod 600` it", flag, path, mode & 0o777)
    if text.endswith("\r\n"):
        text = text[:-2]
    elif text.endswith("\n"):
        text = text[:-1]
    return checked(text, f"{flag} {path}")


def from_env(name: str) -> Optional[str]:
    """The secret in environment variable `name`, checked; None where it is unset or empty."""
    value = os.environ.get(name)
    return checked(value, f"${name}") if value else None
