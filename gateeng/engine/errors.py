"""What the engine refuses or fails with; the fronts map each to a status."""


class QueueFull(RuntimeError):
    """Too many requests waiting; the caller should back off and retry."""


class EngineDead(RuntimeError):
    """The step loop stopped on an error; the engine serves nothing more."""


class DeterminismUnavailable(RuntimeError):
    """VERIFIED was asked for but the invariant plan failed its self-check here."""
