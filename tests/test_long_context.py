"""Long-context language modelling: perplexity per context length against its definition, WikiText's articles,
the validation split packed per context length through Ray Data, and rotary positions past the trained context."""

import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.nn.functional as F
from data_fixtures import ray_local  # noqa: F401

import models
from study.data import load_task_data, parse_dataset_config
from study.data.task_data import context_split
from study.data.text import TokenTargets, Tokenizer, pack_documents
from study.data.text_sources import wikitext_articles
from study.errors import UserError
from study.tasks.base import GeometrySpec
from study.tasks.language_modeling import LanguageModeling, context_metric
from study.worker import Worker

WORKER = Worker(0, 1, torch.device("cpu"))


class Splits:
    """What the loop hands a task (study/loop.py EvalSplits): batches of each evaluated split, and their names."""

    def __init__(self, batches: dict[str, list[dict]]):
        self.batches = batches

    @property
    def names(self):
        return tuple(self.batches)

    def __call__(self, split="val"):
        return iter(self.batches[split])


def _windows(stream: np.ndarray, length: int, rows: int) -> list[dict]:
    """The stream in (length + 1)-token windows of stride length, `rows` per batch, as the worker sees them."""
    steps = TokenTargets(np.ones(257, dtype=np.int16))
    packed = pack_documents([stream], eot=256, seq_len=length)
    return [steps.evaluate({"tokens": torch.from_numpy(packed[i:i + rows])}) for i in range(0, len(packed), rows)]


def test_perplexity_at_each_context_is_the_exponentiated_mean_next_token_loss_over_its_windows():
    torch.manual_seed(0)
    model = models.build_model({"preset": "gpt_tiny", "depth": 2, "context_length": 16, "mixer": "stlt,attention",
                                "stlt_nodes": 4}).eval()
    stream = np.random.default_rng(0).integers(0, 256, 700).astype(np.int32)
    task = LanguageModeling(model, WORKER, seed=0, geometry=GeometrySpec(), hyperparameters={})
    task.setup(Splits({"val": _windows(stream, 16, 8), context_split(64): _windows(stream, 64, 3),
                       context_split(256): _windows(stream, 256, 1)}))
    metrics = task.evaluate(_windows(stream, 16, 8), autocast=torch.autocast("cpu", enabled=False),
                            geometry=False).metrics
    assert set(metrics) >= {"val_ppl", context_metric(64), context_metric(256)}
    assert metrics["val_ppl"] == pytest.approx(math.exp(metrics["val_loss"]))
    for length in (16, 64, 256):
        # The definition, window by window: token t of a window is predicted from the tokens before it in the window.
        losses = []
        with torch.no_grad():
            for window in pack_documents([stream], eot=256, seq_len=length):
                tokens = torch.from_numpy(window).long()[None]
                losses.append(F.cross_entropy(model(tokens[:, :-1])[0], tokens[0, 1:], reduction="none"))
        expected = math.exp(torch.cat(losses).double().mean().item())
        name = "val_ppl" if length == 16 else context_metric(length)
        assert metrics[name] == pytest.approx(expected, rel=1e-5), length
    # Longer windows give every target more context: for this model a different perplexity, not a copy.
    assert len({round(metrics[n], 6) for n in ("val_ppl", context_metric(64), context_metric(256))}) == 3


def test_wikitext_lines_become_articles_at_level_one_headings():
    lines = [" = Alpha = \n", " \n", " Alpha is a letter . \n", " = = History = = \n", " It is old . \n",
             " = Beta = \n", " Beta follows . \n", " \n"]
    (first, second) = wikitext_articles({"text": np.array(lines, dtype=object)}, "text")["text"]
    assert first == "".join(lines[:5]) and second == "".join(lines[5:])
    assert list(wikitext_articles({"text": np.array([" \n"], dtype=object)}, "text")["text"]) == []


def _wikitext_copy(root, articles: int):
    """A local copy of Salesforce/wikitext in the hub's layout (README configs, config/split-*.parquet)."""
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "home"]

    def lines(count):
        out = []
        for a in range(count):
            out += [f" = Article {a} = \n", " \n"]
            out += [" " + " ".join(rng.choice(words, 12)) + " . \n" for _ in range(6)]
        return out

    config = "wikitext-103-raw-v1"
    for split, count in (("train", articles), ("validation", articles // 2)):
        (root / config).mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table({"text": lines(count)}), root / config / f"{split}-00000-of-00001.parquet")
    card = (f"- config_name: {config}\n  data_files:\n  - split: train\n    path: {config}/train-*\n"
            f"  - split: validation\n    path: {config}/validation-*\n")
    (root / "README.md").write_text(f"---\nconfigs:\n{card}---\n")
    return root


def test_wikitext_from_a_local_copy_packs_validation_windows_per_context(ray_local, tmp_path):
    copy = _wikitext_copy(tmp_path / "wikitext", articles=40)
    dataset = {"source": "wikitext103", "local_dir": str(copy), "tokenizer": "byte", "seq_len": 32,
               "eval_contexts": [256, 32]}
    data = load_task_data(parse_dataset_config(dataset), seed=0)
    assert data.splits == ("train", "val", context_split(32), context_split(256))
    assert data.eval_batch_scale == {context_split(32): 1.0, context_split(256): 32 / 256}
    # All validation articles in one stream per context: as many windows as that stream holds.
    val_text = "".join(pq.read_table(copy / "wikitext-103-raw-v1" / "validation-00000-of-00001.parquet")
                       .column("text").to_pylist())
    stream_tokens = len(val_text.encode()) + 20  # every article's bytes and one end-of-text after each of the 20
    for length in (32, 256):
        rows = [row["tokens"] for row in data.datasets[context_split(length)].iter_rows()]
        assert all(len(r) == length + 1 for r in rows)
        assert len(rows) == (stream_tokens - 1) // length, length
    eot = Tokenizer("byte").eot
    first = data.datasets[context_split(256)].take(1)[0]["tokens"]
    assert bytes(t for t in first[:40] if t != eot).decode().startswith(" = Article 0 = ")


def test_a_context_longer_than_the_validation_split_is_refused(ray_local, tmp_path):
    copy = _wikitext_copy(tmp_path / "wikitext", articles=4)
    dataset = {"source": "wikitext103", "local_dir": str(copy), "tokenizer": "byte", "seq_len": 32,
               "eval_contexts": [100_000]}
    with pytest.raises(UserError, match="dataset.eval_contexts: 100000 tokens is longer than the whole validation"):
        load_task_data(parse_dataset_config(dataset), seed=0)


@pytest.mark.parametrize("contexts", [[1], [64, 64]])
def test_bad_context_lists_are_one_line_errors(contexts):
    with pytest.raises(UserError, match="dataset.eval_contexts"):
        parse_dataset_config({"source": "pydoc_text", "eval_contexts": contexts})
