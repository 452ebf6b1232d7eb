"""Long-context language modelling: val_ppl over the packed stream, and perplexity per context length (every
validation document alone in sliding windows, per token and per word, with S_eff) against a brute force over each
target's own context, on one worker and two; WikiText's articles, windowed through Ray Data; the configuration's
checks."""

import math
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

import models
from data_fixtures import ray_local  # noqa: F401
from stlt_fixtures import one_thread  # noqa: F401
from study.data import load_task_data, parse_dataset_config
from study.data.task_data import context_split
from study.data.text import Tokenizer, TokenTargets, document_windows, pack_documents
from study.data.text_sources import wikitext_articles
from study.errors import UserError
from study.runspec import resolve
from study.tasks.base import GeometrySpec
from study.tasks.language_modeling import LanguageModeling, context_metric
from study.worker import Worker

WORKER = Worker(0, 1, torch.device("cpu"))
NO_KEYS = resolve({}, "language_modeling", {}, epochs=1)  # the task's own keys at their defaults


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


def test_val_ppl_is_the_exponentiated_mean_next_token_loss_over_the_packed_stream():
    torch.manual_seed(0)
    model = models.build_model({"preset": "gpt_tiny", "depth": 2, "context_length": 16, "mixer": "stlt,attention",
                                "stlt_nodes": 4}).eval()
    stream = np.random.default_rng(0).integers(0, 256, 300).astype(np.int32)
    task = LanguageModeling(model, WORKER, seed=0, geometry=GeometrySpec(), resolved=NO_KEYS)
    task.setup(Splits({"val": _windows(stream, 16, 8)}))
    metrics = task.evaluate(_windows(stream, 16, 8), autocast=nullcontext(), geometry=False).metrics
    assert metrics["val_ppl"] == pytest.approx(math.exp(metrics["val_loss"]))
    losses = []  # the definition, window by window: token t of a window is predicted from the tokens before it
    with torch.no_grad():
        for window in pack_documents([stream], eot=256, seq_len=16):
            tokens = torch.from_numpy(window).long()[None]
            losses.append(F.cross_entropy(model(tokens[:, :-1])[0], tokens[0, 1:], reduction="none"))
    assert metrics["val_ppl"] == pytest.approx(math.exp(torch.cat(losses).double().mean().item()), rel=1e-5)


# ---- perplexity per context length: each document alone, in sliding windows ----------------------------------------

def window_start(i: int, n: int, length: int, stride: int) -> int:
    """The protocol of docs/data.md, target by target: in [end-of-text] + a document of n tokens, target i (1..n) is
    predicted in the first window, from position 0, if i <= length; else in the first window of `length` inputs
    that ends at length + k * stride (k >= 1), or at the document's end, at or after it."""
    if i <= length:
        return 0
    return min(n, length + stride * math.ceil((i - length) / stride)) - length


def test_document_windows_score_every_token_once_with_its_document_before_it():
    tokenizer = Tokenizer("byte")
    rng = np.random.default_rng(0)
    texts = ["".join(rng.choice(list("ab cd\n"), size)) for size in (1, 5, 9, 10, 11, 40, 97)]
    for length, stride in ((8, 4), (8, 1), (8, 8), (16, 5), (200, 100)):
        out = document_windows({"text": np.array(texts, dtype=object)}, tokenizer, length, stride, "text")
        assert out["tokens"].shape[1] == length + 1
        row = 0
        for text in texts:
            x = [tokenizer.eot, *text.encode()]  # the document behind its end-of-text
            n = len(x) - 1
            scored = []
            first = row
            while len(scored) < n:
                used, count = int(out["length"][row]), int(out["scored"][row])
                window = out["tokens"][row, :used].tolist()
                start = next(b for b in range(n + 1) if x[b:b + used] == window)  # a slice of this document only
                assert used <= length + 1 and (start == 0 or used == length + 1)
                for target in range(start + used - count, start + used):
                    scored.append(target)
                    assert target - start >= min(target, length - stride + 1)  # its context, in tokens
                    assert start == window_start(target, n, length, stride)
                assert (out["tokens"][row, used:] == tokenizer.eot).all()
                row += 1
            assert scored == list(range(1, n + 1))  # every token of the document once, in order
            assert out["words"][first] == len(text.split()) and not out["words"][first + 1:row].any()
        assert row == len(out["tokens"])


def _text_copy(root: Path, documents: list[str]) -> Path:
    """A text_files source: one .txt file per document."""
    root.mkdir()
    for index, text in enumerate(documents):
        (root / f"doc{index:02d}.txt").write_text(text)
    return root


def _brute_force(model, documents: list[str], tokenizer, length: int, stride: int, mixer) -> dict:
    """For every target token of every document, the model run on exactly that target's context (window_start), its
    negative log-likelihood summed; and S_eff over the windows the protocol runs, from the gate's definition:
    the nodes with sigmoid(prefix mean of the layer's input @ W^T + b) >= 0.01 at every position."""
    inputs = []
    hook = mixer.register_forward_pre_hook(lambda module, args: inputs.append(args[0]))
    loss = targets = words = active = positions = 0.0
    with torch.no_grad():
        for text in documents:
            x = torch.tensor([tokenizer.eot, *tokenizer.encode([text])[0].tolist()])
            n, words = len(x) - 1, words + len(text.split())
            for i in range(1, n + 1):
                start = window_start(i, n, length, stride)
                logits = model(x[None, start:i])[0, -1]
                loss -= torch.log_softmax(logits.double(), dim=-1)[x[i]].item()
                targets += 1
            for start in sorted({window_start(i, n, length, stride) for i in range(1, n + 1)}):
                end = max(i for i in range(1, n + 1) if window_start(i, n, length, stride) == start)
                inputs.clear()
                model(x[None, start:end])
                (h,) = inputs
                prefix = h.cumsum(dim=1) / torch.arange(1, h.shape[1] + 1)[:, None]
                alpha = torch.sigmoid(prefix @ mixer.gate_weight.T + mixer.gate_bias)
                active += (alpha >= 0.01).sum().item()
                positions += h.shape[1]
    hook.remove()
    return {"token": math.exp(loss / targets), "word": math.exp(loss / words), "s_eff": active / positions}


DOCUMENTS = [" = Cat = \n The cat sat on the mat , then it ran home . \n",
             "Short one .",
             "a b  c\n\n" + "the quick brown fox jumps over the lazy dog . " * 2,
             " = Mat = \n" + " ".join(f"w{i}" for i in range(20)) + " \n"]


def _tiny_gpt():
    torch.manual_seed(0)
    model = models.build_model({"preset": "gpt_tiny", "depth": 2, "context_length": 16, "mixer": "stlt,attention",
                                "stlt_nodes": 6}).eval()
    with torch.no_grad():  # gates from always on to always off, many of them moving with the prefix
        mixer = model.blocks[0].mixer
        mixer.gate_weight.normal_(0, 1.0)
        mixer.gate_bias.copy_(torch.linspace(6, -9, 6))
    return model


def _rows(data) -> dict[str, list[dict]]:
    """The rows of every evaluated split of a materialised TaskData, in order."""
    return {name: data.datasets[name].take_all() for name in data.splits if name != "train"}


def _evaluate(rows: dict[str, list[dict]], batch_steps, model, worker=WORKER) -> dict:
    """The task's evaluation on this worker's rows of each split (every `worker.world`-th from its rank), in
    batches of 3 as the worker reads them."""
    def batches(split):
        mine = rows[split][worker.rank::worker.world]
        for i in range(0, len(mine), 3):
            yield batch_steps.evaluate({key: torch.from_numpy(np.stack([row[key] for row in mine[i:i + 3]]))
                                        for key in mine[0]})

    task = LanguageModeling(model, worker, seed=0, geometry=GeometrySpec(), resolved=NO_KEYS)
    task.setup(Splits({split: list(batches(split)) for split in rows}))
    return task.evaluate(batches("val"), autocast=nullcontext(), geometry=False).metrics


@pytest.mark.usefixtures("one_thread")
def test_perplexity_per_context_is_each_tokens_exact_context_and_per_word_divides_by_words(ray_local, tmp_path):
    """Through Ray Data from text files: at each length the per-token and per-word perplexity and S_eff equal the
    brute force over each target's own context; lengths past every document give the whole-document numbers."""
    copy = _text_copy(tmp_path / "docs", DOCUMENTS)
    longest = max(len(text.encode()) for text in DOCUMENTS)
    contexts = [8, 32, longest + 1, 2 * longest]
    dataset = {"source": "text_files", "path": str(copy), "val_path": str(copy), "tokenizer": "byte", "seq_len": 16,
               "eval_contexts": contexts, "eval_stride": 5}
    data = load_task_data(parse_dataset_config(dataset), seed=0)
    assert data.params["eval_stride_ctx8"] == 5
    model = _tiny_gpt()
    rows = _rows(data)
    metrics = _evaluate(rows, data.batch_steps, model)
    tokenizer = Tokenizer("byte")
    for length in contexts[:3]:
        expected = _brute_force(model, DOCUMENTS, tokenizer, length, 5, model.blocks[0].mixer)
        assert metrics[context_metric(length, "token")] == pytest.approx(expected["token"], rel=1e-5), length
        assert metrics[context_metric(length, "word")] == pytest.approx(expected["word"], rel=1e-5), length
        assert metrics[f"stlt_s_eff_l0_ctx{length}"] == pytest.approx(expected["s_eff"], rel=1e-12), length
        assert 0 < expected["s_eff"] < 6
    # per word: the same loss over fewer units
    assert metrics[context_metric(8, "word")] > metrics[context_metric(8, "token")]
    # more context changes the numbers; past every document it cannot
    assert metrics[context_metric(8, "token")] != metrics[context_metric(32, "token")]
    for unit in ("token", "word"):
        assert metrics[context_metric(longest + 1, unit)] == metrics[context_metric(2 * longest, unit)]
    # Two workers, each with every other row of each split: the same numbers (sums all-reduced, words once each).
    out = tmp_path / "rank0.pt"
    mp.spawn(_two_workers, args=(str(tmp_path / "init"), rows, data.batch_steps, str(out)), nprocs=2, join=True)
    merged = torch.load(out, weights_only=False)
    for length in contexts:
        for name in (context_metric(length, "token"), context_metric(length, "word"), f"stlt_s_eff_l0_ctx{length}"):
            assert merged[name] == pytest.approx(metrics[name], rel=1e-6), name  # float32 sums in another order
    assert merged["stlt_s_eff_l0"] == pytest.approx(metrics["stlt_s_eff_l0"], rel=1e-12)


def _two_workers(rank, init_file, rows, batch_steps, out_file):
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    metrics = _evaluate(rows, batch_steps, _tiny_gpt(), Worker(rank, 2, torch.device("cpu")))
    if rank == 0:
        torch.save(metrics, out_file)
    torch.distributed.destroy_process_group()


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


def test_wikitext_from_a_local_copy_windows_each_validation_article_alone(ray_local, tmp_path):
    copy = _wikitext_copy(tmp_path / "wikitext", articles=40)
    dataset = {"source": "wikitext103", "local_dir": str(copy), "tokenizer": "byte", "seq_len": 32,
               "eval_contexts": [256, 32]}
    data = load_task_data(parse_dataset_config(dataset), seed=0)
    assert data.splits == ("train", "val", context_split(32), context_split(256))
    assert data.eval_batch_scale == {context_split(32): 1.0, context_split(256): 32 / 256}
    lines = pq.read_table(copy / "wikitext-103-raw-v1" / "validation-00000-of-00001.parquet").column("text")
    articles = wikitext_articles({"text": np.array(lines.to_pylist(), dtype=object)}, "text")["text"]
    assert len(articles) == 20
    eot = Tokenizer("byte").eot
    for length in (32, 256):
        rows = data.datasets[context_split(length)].take_all()
        # every byte of every article a target once, the articles' words once, one first window per article
        assert sum(int(row["scored"]) for row in rows) == sum(len(a.encode()) for a in articles), length
        assert sum(int(row["words"]) for row in rows) == sum(len(a.split()) for a in articles), length
        firsts = [row for row in rows if row["tokens"][0] == eot]
        assert [bytes(row["tokens"][1:21].tolist()).decode() for row in firsts] == \
            [a.encode()[:20].decode() for a in articles]
        assert data.params[f"eval_stride_ctx{length}"] == length // 2  # the default: half of each length


def test_a_stride_longer_than_the_shortest_context_is_refused():
    with pytest.raises(UserError, match="dataset.eval_stride: at most the shortest of eval_contexts \\(64\\)"):
        parse_dataset_config({"source": "pydoc_text", "eval_contexts": [256, 64], "eval_stride": 65})


@pytest.mark.parametrize("contexts", [[1], [64, 64]])
def test_bad_context_lists_are_one_line_errors(contexts):
    with pytest.raises(UserError, match="dataset.eval_contexts"):
        parse_dataset_config({"source": "pydoc_text", "eval_contexts": contexts})
