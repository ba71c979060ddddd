"""The one exception type for mistakes a user can fix.

The CLI prints a :class:`UserError` as a short paragraph and exits with code 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """A problem in the user's input, with a message that says what would fix it."""

    exit_code = 2
