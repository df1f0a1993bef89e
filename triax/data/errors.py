"""Errors of the data layer: triax errors a user can also catch as the built-in class."""

from triax.errors import ConfigError, TriaxError


class DataError(ConfigError, ValueError):
    """A data file, directory or setting is unusable (missing, malformed, out of range)."""


class MissingDependency(TriaxError, ImportError):
    """An optional package this feature needs is not installed; the message says how to install it."""
