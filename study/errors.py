"""The one error type for user mistakes, and the one way schema errors become it.

The CLI prints a `UserError` as a single line and exits with code 2. Every pydantic schema of `study/` is applied to
user data through `validate`, so a bad field always reads the same way: its path, what is wrong, what is allowed.
"""

from __future__ import annotations

import difflib
import re
import types
import typing
from typing import Any, TypeVar

from pydantic import BaseModel, TypeAdapter, ValidationError

T = TypeVar("T")


class UserError(Exception):
    """A mistake in a search space, a config, a command line or the environment the user pointed us at.

    The message is one line that names the field and the allowed values; no traceback is shown for it. `field`
    names the configuration key at fault when there is one (callers use it to decide which checks can wait).
    """

    def __init__(self, message: str, field: str | None = None):
        super().__init__(" ".join(str(message).split()))
        self.field = field


def validate(schema: type[T] | Any, data: Any, prefix: str = "") -> T:
    """`data` checked against `schema` (a pydantic model, or a type such as a discriminated union of models).
    A failure is a UserError: `prefix` + the first problem's field path, the problem, what that place allows, and
    how many more problems there are; `UserError.field` is the first element of the path."""
    try:
        if isinstance(schema, type) and issubclass(schema, BaseModel):
            return schema.model_validate(data)
        return TypeAdapter(schema).validate_python(data)
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        path = _field_path(first["loc"], data)
        raise UserError(_describe(exc, data, prefix, schema), field=path[0] if path else None) from None


def validate_flags(schema: type[T], values: dict, flags: dict[str, str]) -> T:
    """`validate` for command-line flags that set a schema's fields, so that the flags obey the schema's own rules:
    a refusal names the flags (`flags`: field -> flag) wherever its message names their fields."""
    try:
        return validate(schema, values)
    except UserError as exc:
        message = re.sub(rf"\b({'|'.join(map(re.escape, flags))})\b", lambda m: flags[m[1]], str(exc))
        raise UserError(message, field=flags.get(exc.field, exc.field)) from None


def _describe(error: ValidationError, data: Any, prefix: str, schema) -> str:
    problems = error.errors(include_url=False)
    first = problems[0]
    path = _field_path(first["loc"], data)
    message = first["msg"]
    if first["type"] == "extra_forbidden":
        message = "is not a known field"
        known = _known_fields(schema, first["loc"], data)
        if known:
            unknown = str(first["loc"][-1])
            close = difflib.get_close_matches(unknown, known, n=1)
            message += (f" (did you mean {close[0]!r}?)" if close else "") + f"; allowed: {', '.join(known)}"
    elif first["type"] == "missing":
        message = "is required"
    elif first["type"] in ("union_tag_invalid", "union_tag_not_found"):
        context = first.get("ctx", {})
        path.append(str(context.get("discriminator", "")).strip("'"))
        allowed = ", ".join(tag.strip("' ") for tag in str(context.get("expected_tags", "")).split(","))
        got = context.get("tag")
        message = f"{got!r} is not one of {allowed}" if got is not None else f"is required; one of {allowed}"
    message = message.removeprefix("Value error, ")
    more = f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})" if len(problems) > 1 else ""
    location = ".".join(p for p in path if p)
    where = f"{prefix}{location}" if location else (prefix.rstrip(".: ") or "value")
    return f"{where}: {message}{more}"


def _field_path(loc: tuple, data: Any) -> list[str]:
    """The error's location as the user wrote it: without the tags pydantic inserts for a discriminated union
    (``parameters.k.int.low`` is ``parameters.k.low``) or for validator functions."""
    path, node = [], data
    for part in loc:
        if isinstance(part, str) and part.startswith("function-"):
            continue
        if isinstance(node, dict) and isinstance(part, str) and part not in node:
            if part in {str(node.get(tag)) for tag in ("type", "source", "kind")}:
                continue  # a union tag, not a field
        path.append(str(part))
        node = _child(node, part)
    return path


def _known_fields(schema, loc: tuple, data: Any) -> list[str] | None:
    """The field names of the pydantic model that holds the last element of `loc`, found by walking the schema's
    annotations along the path (unions resolved by their tag in the data); None when it cannot be told."""
    node_type, node = schema, data
    for part in loc[:-1]:
        if isinstance(part, str) and part.startswith("function-"):
            continue
        node_type = _resolve(node_type, node)
        if _is_model(node_type):
            if part not in node_type.model_fields:
                continue  # a union tag pydantic put in the path
            node_type = node_type.model_fields[part].annotation
        elif typing.get_origin(node_type) is dict:
            node_type = typing.get_args(node_type)[1]
        elif typing.get_origin(node_type) is list:
            node_type = typing.get_args(node_type)[0]
        else:
            return None
        node = _child(node, part)
    node_type = _resolve(node_type, node)
    return list(node_type.model_fields) if _is_model(node_type) else None


def _child(node: Any, part: Any) -> Any:
    """The value at `part` of a parsed YAML node, or None where the path leaves the data."""
    if isinstance(node, dict):
        return node.get(part)
    if isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
        return node[part]
    return None


def _is_model(value) -> bool:
    return isinstance(value, type) and hasattr(value, "model_fields")


def _resolve(annotation, data):
    """Strip Annotated and pick, in a union, the model the data selects (by its type/source/kind tag)."""
    while typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        candidates = [a for a in map(lambda a: _resolve(a, data), typing.get_args(annotation)) if _is_model(a)]
        if len(candidates) == 1:
            return candidates[0]
        for candidate in candidates:
            for tag in ("type", "source", "kind"):
                field = candidate.model_fields.get(tag)
                if isinstance(data, dict) and field is not None and data.get(tag) in typing.get_args(field.annotation):
                    return candidate
        non_model = [a for a in typing.get_args(annotation) if typing.get_origin(a) in (dict, list)]
        return non_model[0] if len(non_model) == 1 and not candidates else None
    return annotation
