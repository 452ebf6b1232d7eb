"""Configuration errors that name the offending field and what it allows."""


class ConfigError(ValueError):
    """A model configuration value is missing, unknown or out of range.

    `field` is the flat-config key (or `key[index]`) at fault, so callers can point the user at it.
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def __reduce__(self):
        # Errors raised inside Ray workers travel pickled; the default reduction would call __init__ with the
        # formatted text only.
        return type(self), (self.field, self.message)
