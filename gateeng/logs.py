"""The one log of the engine and the server: the `gateeng` logger (modules log to it
or to a child of it), one line a message on stderr (then the traceback, for a
logged exception), never on stdout, so a tool's output stays clean. Warnings and
errors name their level."""
import logging
import sys

LOGGER = logging.getLogger("gateeng")


class _Stderr(logging.Handler):
    """Writes to sys.stderr as it is at each message (test captures replace it)."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(self.format(record), file=sys.stderr, flush=True)
        except Exception:
            self.handleError(record)


class _Format(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        level = f"{record.levelname} " if record.levelno >= logging.WARNING else ""
        line = f"[gateeng] {level}{record.getMessage()}"
        return f"{line}\n{self.formatException(record.exc_info)}" if record.exc_info else line


LEVELS = ("debug", "info", "warning", "error")   # `--log-level`'s names
DEFAULT_LEVEL = "info"

_handler = _Stderr()
_handler.setFormatter(_Format())
LOGGER.addHandler(_handler)
LOGGER.setLevel(DEFAULT_LEVEL.upper())
LOGGER.propagate = False


def set_level(name: str) -> None:
    """`--log-level`: one of LEVELS."""
    LOGGER.setLevel(getattr(logging, name.upper()))


def log(msg: str) -> None:
    """Progress and warnings for people."""
    LOGGER.info(msg)
