"""User-facing errors: the exceptions the CLI turns into one clear message and a non-zero exit.

Every error a user can cause (bad flag, missing data, wrong checksum, an existing run folder)
raises a subclass of :class:`LocalclipError` whose message names the offending value, file or
rank. Programming errors stay ordinary exceptions with tracebacks.
"""


class LocalclipError(Exception):
    """Base class of errors caused by the user's input or environment."""


class ConfigError(LocalclipError, ValueError):
    """An invalid configuration value, flag or recipe."""


class DataError(LocalclipError):
    """Missing, corrupt or malformed data (names the path and how to fix it)."""


class RunFolderError(LocalclipError):
    """A run folder that cannot be used as asked (exists, differs, is finished)."""


class CommunicationError(LocalclipError, RuntimeError):
    """A collective failed: a peer died, timed out or disagreed."""


class NonFiniteError(LocalclipError, FloatingPointError):
    """NaN or Inf in gradients or parameters, with ``on_nonfinite="raise"``."""


class Interrupted(LocalclipError):
    """The run stopped on SIGTERM/SIGINT after writing a checkpoint; ``--resume`` continues it."""

    exit_code = 75  # EX_TEMPFAIL: try again later (with --resume)
