"""Errors a user can fix. The CLI and the server print these as one line (no
traceback); every message says what was wrong and how to fix it."""


class UserError(ValueError):
    """Bad input from a user: a wrong flag, a bad prompt, a missing file."""


class CheckpointError(UserError):
    """A model or drafter folder that is missing, truncated or mismatched."""
