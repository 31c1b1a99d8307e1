"""The one exception type that reaches users as a single line and exit code 2."""


class ExitbenchError(Exception):
    """Bad input or an unusable file: the message must name the bad thing and what would be right."""


class CheckpointError(ExitbenchError):
    """A checkpoint directory that cannot be loaded as it is."""
