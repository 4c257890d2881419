"""What the engine refuses or fails with; the fronts map each to a status."""


class QueueFull(RuntimeError):
    """Too many requests waiting; the caller should back off and retry."""


class EngineDead(RuntimeError):
    """The step loop stopped on an error; the engine serves nothing more."""


class DeterminismUnavailable(RuntimeError):
    """VERIFIED was asked for but the invariant plan failed its self-check here."""


class WeightsRefused(ValueError):
    """A weight update's checkpoint is not one the served model can take (a tensor
    missing, extra, of another shape or dtype, not finite; an unreadable file;
    another config). The message names the tensor or file; nothing changed."""


class WeightUpdateUnavailable(RuntimeError):
    """This engine cannot take weights in place (tensor parallelism, CUDA); nothing changed."""
