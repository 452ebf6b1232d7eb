"""YAML in and out: floats written the way people write them (``1e-3``), a key given twice refused (PyYAML keeps
the last one silently), errors as one line with a position."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from study.errors import UserError


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads ``1e-3`` (no dot) as a string; researchers write learning rates exactly like that. A mapping
    with a key twice is an error: the second `epochs:` of a space is a mistake, not a setting."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value if isinstance(node, yaml.MappingNode) else ():
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults`: a key the mapping sets again overrides the merged one, as YAML means
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.setdefault(key, key_node)
            except TypeError:  # an unhashable key: the base class says so
                continue
            if first is not key_node:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (line {first.start_mark.line + 1} and line "
                                f"{key_node.start_mark.line + 1}); give it once", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load_yaml(path: str | Path, what: str = "file") -> Any:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"{what} {path}: cannot be read ({exc})") from None
    return parse_yaml(text, f"{what} {path}")


def parse_yaml(text: str, where: str = "YAML") -> Any:
    try:
        return yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        position = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise UserError(f"{where}: not valid YAML{position}: {problem}") from None


def dump_yaml(data: Any) -> str:
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True, width=120)
