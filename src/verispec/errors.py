"""User-facing errors.

Anything the user can fix (a bad path, a corrupt file, an out-of-range parameter) raises
:class:`VerispecError`; the CLI prints its message on one line and exits with status 2.
"""


class VerispecError(Exception):
    """A problem with the user's input, reported as one line without a traceback."""


class ConfigError(VerispecError, ValueError):
    """An out-of-range or inconsistent parameter (also a ValueError for API users)."""
