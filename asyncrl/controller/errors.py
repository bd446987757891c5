"""The one error the controller raises when a run cannot finish."""


class RunError(RuntimeError):
    """The run could not finish: a process died, stalled, or never started."""
