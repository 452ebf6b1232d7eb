"""docs/config.md cannot drift: its key tables are what `python -m study.docs` writes from the schemas, and every key
a search space, a run config or a model reads has a row, found independently of the generator (pydantic's JSON
schema of each file's root model, the keys `build_model` accepts)."""

from __future__ import annotations

import re

import pytest

import models
from models.keys import MIXER_KEY_DOCS, MODEL_KEY_DOCS
from study import docs
from study.runspec import RunSpec, TrainConfig
from study.space import SearchSpace
from study.tasks import TASKS

TEXT = docs.CONFIG_MD.read_text()
ROW = re.compile(r"^\| `([^`]+)` \|", re.MULTILINE)


def _table_of(model_name: str) -> set[str]:
    """The keys of the table under the heading that names `model_name`."""
    heading = re.search(rf"^### .*\(`{model_name}`\)$", TEXT, re.MULTILINE)
    assert heading, f"docs/config.md has no table of {model_name}"
    body = TEXT[heading.end():]
    body = body[:min(i for i in (body.find("\n### "), body.find("\n<!-- end of "), len(body)) if i >= 0)]
    return set(ROW.findall(body))


def _schemas() -> dict[str, set[str]]:
    """Every pydantic model a YAML file can reach, with its keys: the roots and their JSON schema's definitions."""
    roots = [SearchSpace, RunSpec, TrainConfig, *(t.options for t in TASKS.values() if t.options is not None)]
    found = {}
    for root in roots:
        schema = root.model_json_schema()
        found[root.__name__] = set(schema["properties"])
        found.update({name: set(d.get("properties", {})) for name, d in schema.get("$defs", {}).items()})
    return found


def test_config_md_is_what_the_generator_writes():
    assert docs.rewrite(TEXT, docs.generated_sections()) == TEXT, "docs/config.md is out of date: run `make docs`"
    assert docs.main(["--check"]) == 0


def test_the_check_fails_on_a_hand_edit_and_on_missing_markers():
    edited = TEXT.replace("| `lr` |", "| `lr ` |", 1)
    assert edited != TEXT and docs.rewrite(edited, docs.generated_sections()) == TEXT
    with pytest.raises(KeyError, match="training"):
        docs.rewrite(TEXT.replace(docs.BEGIN.format("training"), ""), docs.generated_sections())


@pytest.mark.parametrize("name", sorted(_schemas()))
def test_every_key_of_every_schema_has_a_row_in_its_table(name):
    assert _schemas()[name] <= _table_of(name)


def test_every_model_key_has_exactly_one_entry_and_a_row():
    assert set(MODEL_KEY_DOCS) | set(MIXER_KEY_DOCS) == set(models.MODEL_KEYS)
    assert not set(MODEL_KEY_DOCS) & set(MIXER_KEY_DOCS)
    for section, keys in (("model-keys", MODEL_KEY_DOCS), ("mixer-keys", MIXER_KEY_DOCS)):
        body = TEXT.split(docs.BEGIN.format(section))[1].split(docs.END.format(section))[0]
        assert ROW.findall(body) == list(keys)


def test_the_models_column_is_read_from_the_families():
    body = TEXT.split(docs.BEGIN.format("model-keys"))[1].split(docs.END.format("model-keys"))[0]
    rows = {match[1]: match[2] for match in re.finditer(r"^\| `(\w+)` \| ([^|]+) \|", body, re.MULTILINE)}
    assert rows["pool"].strip() == "vit" and rows["block_style"].strip() == "gpt"
    assert rows["vocab_size"].strip() == "gpt, encdec" and rows["dim"].strip() == "all"


def test_a_field_is_rendered_from_its_schema():
    # Known answers: types, bounds and defaults as the schema states them.
    lines = docs.schema_table(TrainConfig)
    assert "| `beta1` | float in [0, 1) | `0.9` |" in "\n".join(lines)
    assert any(line.startswith("| `steps_per_epoch` | int >= 1 \\| null | null |") for line in lines)
    assert any(line.startswith("| `lr_decay` | `cosine` \\| `inverse_sqrt` | `cosine` |") for line in lines)


def test_every_row_says_what_its_key_means():
    """A field without a description would be a row without a meaning: the schemas describe every field."""
    rows = re.findall(r"^\| `([^`]+)` \|.*\| *([^|]*?) *\|$", TEXT, re.MULTILINE)
    assert len(rows) > 300
    assert [key for key, meaning in rows if not meaning] == []
