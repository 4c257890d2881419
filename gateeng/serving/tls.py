"""TLS on both fronts, from vLLM's flags: `--ssl-certfile` (the certificate chain,
PEM), `--ssl-keyfile` (its private key, PEM, unencrypted) and, where given,
`--ssl-ca-certs` (PEM CAs: a client must then present a certificate one of them
signed). The files are read and checked once, at start: a missing or unreadable
file, a key that does not match the certificate or a CA file without a certificate
is a clear start-up error (ValueError), never a failure at the first handshake.

The HTTP front takes an ssl.SSLContext (http_server.py), gRPC its own server
credentials over the same bytes (grpc_api.py). TLS 1.2 at least on both.
"""
from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Optional

from gateeng.config import TlsFiles


@dataclass(frozen=True)
class ServerTls:
    """The files' bytes, checked, and the HTTP front's context over them."""
    chain: bytes
    key: bytes
    ca: Optional[bytes]
    context: ssl.SSLContext

    def grpc_credentials(self):
        import grpc
        return grpc.ssl_server_credentials([(self.key, self.chain)], root_certificates=self.ca,
                                           require_client_auth=self.ca is not None)


def _read(path: str, flag: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"{flag} {path}: cannot read it: {e.strerror or e}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{flag} {path}: not a PEM file (no -----BEGIN line)")
    return data


def load(files: TlsFiles) -> Optional[ServerTls]:
    """The server's TLS, checked; None where `files` enables none."""
    files.validate()
    if not files.enabled:
        return None
    chain = _read(files.certfile, "--ssl-certfile")
    key = _read(files.keyfile, "--ssl-keyfile")
    ca = _read(files.ca_certs, "--ssl-ca-certs") if files.ca_certs else None
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["http/1.1"])
    try:
        context.load_cert_chain(files.certfile, files.keyfile)
    except ssl.SSLError as e:
        raise ValueError(f"--ssl-certfile {files.certfile} with --ssl-keyfile {files.keyfile}: not a certificate "
                         f"and its private key ({e.reason or e})") from None
    if ca is not None:
        try:
            context.load_verify_locations(cadata=ca.decode("ascii", "replace"))
        except ssl.SSLError as e:
            raise ValueError(f"--ssl-ca-certs {files.ca_certs}: no CA certificate in it ({e.reason or e})") from None
        context.verify_mode = ssl.CERT_REQUIRED
    return ServerTls(chain, key, ca, context)


def client_credentials(ca_file: Optional[str] = None, cert_file: Optional[str] = None,
                       key_file: Optional[str] = None):
    """gRPC channel credentials for our clients: the server's certificate checked against
    `ca_file` (None: the system's roots), and a client certificate where the server asks
    for one."""
    import grpc
    if bool(cert_file) != bool(key_file):
        raise ValueError("a client certificate needs both its file and its key")
    root = _read(ca_file, "--ca-file") if ca_file else None
    chain = _read(cert_file, "--client-cert") if cert_file else None
    key = _read(key_file, "--client-key") if key_file else None
    return grpc.ssl_channel_credentials(root_certificates=root, private_key=key, certificate_chain=chain)
