"""The one error type for user mistakes: the CLI prints its message as a single line and exits with code 2."""


class UserError(Exception):
    """A mistake in a search space, a config, a command line or the environment the user pointed us at.

    The message is one line that names the field and the allowed values; no traceback is shown for it.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))
