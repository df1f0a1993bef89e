"""User-facing errors.

A `TriaxError` is a mistake the user can fix (bad config, missing file, impossible layout).
The command line prints its message as one line and exits non-zero, without a traceback
unless `--debug` or `TRIAX_DEBUG=1` asks for one. Anything else is a bug and keeps its traceback.
"""


import unicodedata

# Characters never written raw to a terminal: controls (ESC starts an escape sequence that can
# recolour, retitle or rewrite the screen), format characters (bidirectional overrides reorder
# what is shown), line and paragraph separators, lone surrogates.
_UNPRINTED = ("Cc", "Cf", "Zl", "Zp", "Cs")


def printable(text: str, keep: str = "") -> str:
    """`text` as it may reach a terminal: a name from a config or a file (a run directory, a path)
    or model output, with every character of _UNPRINTED but those in `keep` escaped (\\x1b)."""
    return "".join(ch if ch in keep or unicodedata.category(ch) not in _UNPRINTED else ascii(ch)[1:-1]
                   for ch in text)


class TriaxError(Exception):
    """A problem with the user's input or environment, described in one actionable line."""


class ConfigError(TriaxError):
    """The configuration is invalid: names the key, the value, and what to do instead."""


class UsageError(TriaxError, ValueError):
    """A command-line argument is malformed or out of range: names the option and the value."""


class UnsupportedFeatureError(TriaxError, NotImplementedError):
    """A part of the library a door imitates (Accelerate, FairScale, ...) that triax deliberately
    does not provide; the message names the alternative."""
