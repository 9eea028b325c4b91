"""Errors a user can act on. The CLI prints them as one line (tracebacks only with -v)."""


class MilesError(Exception):
    """Base class: something the user can fix (a recipe, a path, a plugin)."""


class ConfigError(MilesError):
    """The recipe or an override is invalid."""


class ComponentError(MilesError):
    """A named component is unknown, broken, claimed twice, or does not satisfy its interface."""


class DataError(MilesError):
    """A dataset file is missing or has a bad record."""


class ModelError(MilesError):
    """A model path is not a usable model."""


class EngineError(MilesError):
    """A rollout engine could not start, or answered with an error."""


class EngineRejected(EngineError):
    """An engine answered HTTP 400: it refused the request as given (a prompt longer than its
    context, a setting it does not take). The request is at fault, not the engine."""


class RunDirError(MilesError):
    """The run directory holds earlier results that would be overwritten."""


class ToolError(MilesError):
    """A tool call the model got wrong (unknown tool, bad arguments); the model sees the message."""


class RunInterrupted(MilesError):
    """SIGINT or SIGTERM stopped the run at a safe point (after a step; checkpointed when saving is on)."""

    def __init__(self, message: str, *, signum: int, steps_done: int, checkpoint: str | None) -> None:
        super().__init__(message)
        self.signum = signum
        self.steps_done = steps_done
        self.checkpoint = checkpoint


class RunComplete(MilesError):
    """``--resume`` of a run that already trained every step: nothing was started."""
