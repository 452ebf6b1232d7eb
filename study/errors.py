"""The one error type for user mistakes: the CLI prints its message as a single line and exits with code 2."""

from __future__ import annotations

from typing import Any


class UserError(Exception):
    """A mistake in a search space, a config, a command line or the environment the user pointed us at.

    The message is one line that names the field and the allowed values; no traceback is shown for it.
    """

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def describe_validation_error(error, data: Any = None, prefix: str = "") -> str:
    """One line for a pydantic ValidationError: the first problem with its field path, and how many more.

    `data` is the validated input: it lets us drop the tags pydantic inserts into the path of a discriminated
    union (``parameters.k.int.low`` becomes ``parameters.k.low``).
    """
    problems = error.errors(include_url=False)
    first = problems[0]
    location = ".".join(_field_path(first["loc"], data))
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "is not a known field"
    elif first["type"] == "missing":
        message = "is required"
    message = message.removeprefix("Value error, ")
    more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
    where = f"{prefix}{location}" if location else (prefix.rstrip(".: ") or "value")
    return f"{where}: {message}{more}"


def _field_path(loc: tuple, data: Any) -> list[str]:
    path, node = [], data
    for part in loc:
        if isinstance(part, str) and part.startswith("function-"):
            continue
        if isinstance(node, dict) and isinstance(part, str) and part not in node:
            if part in {str(node.get(tag)) for tag in ("type", "source", "kind")}:
                continue  # a union tag, not a field
        path.append(str(part))
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            node = None
    return path
