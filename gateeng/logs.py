"""Progress and warnings for people: one line each, on stderr, never on stdout."""
import sys


def log(msg: str) -> None:
    print(f"[gateeng] {msg}", file=sys.stderr, flush=True)
