"""The `chat` source: nanochat's mid-training and SFT mixtures (SmolTalk, MMLU, GSM8K, ARC from the hub or a local
copy of it, its spelling tasks generated from a word list) and local JSONL conversations, rendered with nanochat's
chat template inside Ray Data (study/data/chat.py)."""

from __future__ import annotations

import dataclasses
import os

import ray

from study.data.build import TEXT_MAP_BATCH
from study.data.chat import PartFiles, read_parts, render_batch
from study.data.config import ChatConfig, ChatPart
from study.data.fetch import check_fetchable
from study.data.hub import MIRROR_ENV, hub_reachable, local_copy, resolve_parquet_files
from study.data.task_data import TaskData
from study.data.text import Tokenizer, TokenTargets, resolve_tokenizer
from study.errors import UserError


def _parts(cfg: ChatConfig):
    return [(f"dataset.{side}[{i}]", part) for side in ("train", "val") for i, part in enumerate(getattr(cfg, side))]


def check_chat(cfg: ChatConfig) -> None:
    """Before Ray: every JSONL file exists, and every hub part has a local copy or a reachable hub (a one-line error
    naming the offline alternative otherwise)."""
    for where, part in _parts(cfg):
        if part.hub is None:
            what = "a .jsonl file of conversations" if part.name == "jsonl" else "a word list, one word per line"
            check_fetchable(part.path, part.url, f"{where}.path", what)
            continue
        if part.local_dir and not os.path.isdir(os.path.expanduser(part.local_dir)):
            raise UserError(f"{where}.local_dir: {part.local_dir} is not a folder (a local copy of {part.hub[0]})")
        if local_copy(part.hub[0], part.local_dir) is None:
            reachable, why = hub_reachable()
            if not reachable:
                raise UserError(
                    f"{where}: {part.name} streams {part.hub[0]} from the Hugging Face hub, which is not reachable "
                    f"({why}); offline, use a part {{name: jsonl, path: conversations.jsonl}} (local conversations, "
                    f"tests/fixtures/chat/ has examples of each set), or set its local_dir (or ${MIRROR_ENV}) to a "
                    "local copy of the hub repository")


def _part_files(part: ChatPart, where: str) -> PartFiles:
    """Where one part's rows are: its .jsonl file, or its split's parquet files in the hub or a local copy."""
    if part.hub is None:  # fetched (when missing) where it is read: Ray Data's task may run on another node
        return PartFiles(part.name, (os.path.expanduser(part.path),), stop=part.stop, url=part.url,
                         size=part.size, split=part.split or "train")
    hub_id, config_name, default_split = part.hub
    hub = resolve_parquet_files(hub_id, config_name=config_name, revision=part.revision, local_dir=part.local_dir,
                                source="chat", what=f"{hub_id} ({config_name or 'default'})")
    files = hub.files(part.split or default_split, f"{where.removeprefix('dataset.')}.split")
    return PartFiles(part.name, tuple(files), hub.filesystem, part.stop)


def _mixture(parts: list[ChatPart], side: str):
    """The conversations of every part (each `repeat` times) as one Ray dataset of {"messages": JSON text}."""
    files = [_part_files(part, f"dataset.{side}[{i}]") for i, part in enumerate(parts)]
    rows = [{"part": i} for i, part in enumerate(parts) for _ in range(part.repeat)]
    return ray.data.from_items(rows).map_batches(read_parts, fn_kwargs={"parts": files}, batch_size=1,
                                                 batch_format="numpy")


def load_chat(cfg: ChatConfig, seed: int, previous: Tokenizer | None = None) -> TaskData:
    """The training mixture in one fixed shuffle (split_seed; nanochat's TaskMixture shuffles once with seed 42),
    the validation mixture in order; both rendered to windows with a loss mask. tokenizer: nanochat reads with
    the BPE of tokenizer_file, else with `previous`, the tokenizer of the stage before (the one its pre-training
    trained, as nanochat's mid_train and chat_sft read with tok_train's)."""
    check_chat(cfg)
    if cfg.tokenizer != "nanochat" or cfg.tokenizer_file:
        tokenizer = dataclasses.replace(resolve_tokenizer(cfg.tokenizer, cfg.tokenizer_file), chat=True)
    elif previous is not None and previous.kind == "nanochat":
        tokenizer = previous
    else:
        raise UserError("dataset.tokenizer: a chat source's nanochat BPE is the one the stage before it trained (a "
                        "later stage after a pre-training with tokenizer: nanochat), or set dataset.tokenizer_file")
    train = _mixture(cfg.train, "train").random_shuffle(seed=cfg.split_seed)
    val = _mixture(cfg.val, "val")
    kwargs = {"tokenizer": tokenizer, "seq_len": cfg.seq_len, "loss_on": cfg.loss_on}
    train, val = (rows.map_batches(render_batch, fn_kwargs=kwargs, batch_size=TEXT_MAP_BATCH, batch_format="numpy")
                  for rows in (train, val))
    return TaskData(
        datasets={"train": train, "val": val},
        model_overrides={"vocab_size": tokenizer.vocab_size, "context_length": cfg.seq_len},
        num_train=None, num_val=None,
        batch_steps=TokenTargets(tokenizer.token_bytes()),
        params={"source": "chat", "tokenizer": tokenizer.name, "chat_tokens": True, "loss_on": cfg.loss_on,
                **({"tokenizer_file": tokenizer.file} if tokenizer.file else {}),
                "train_parts": ",".join(p.name for p in cfg.train), "val_parts": ",".join(p.name for p in cfg.val)},
        shuffle_buffer=cfg.shuffle_buffer,
        tokenizer=tokenizer,
    )
