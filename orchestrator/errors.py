"""What the CLI reports as the user's mistake rather than as a crash."""


class UsageError(Exception):
    """Bad input from the user: printed without a traceback, exit code 2."""
