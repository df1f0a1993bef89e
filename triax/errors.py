"""User-facing errors.

A `TriaxError` is a mistake the user can fix (bad config, missing file, impossible layout).
The command line prints its message as one line and exits non-zero, without a traceback
unless `--debug` or `TRIAX_DEBUG=1` asks for one. Anything else is a bug and keeps its traceback.
"""


class TriaxError(Exception):
    """A problem with the user's input or environment, described in one actionable line."""


class ConfigError(TriaxError):
    """The configuration is invalid: names the key, the value, and what to do instead."""


class UsageError(TriaxError, ValueError):
    """A command-line argument is malformed or out of range: names the option and the value."""
