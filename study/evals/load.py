"""A trained language model back from a run config and its checkpoint: what `lapstudy eval CONFIG_OR_RUN` reads.

CONFIG_OR_RUN is one of
- a run config (what `lapstudy export` or `lapstudy train` writes); its checkpoint is `--checkpoint`, else found
  where the project leaves it: beside a `lapstudy train` config (`<storage>/<name>.yaml` -> `<storage>/<name>/`), or,
  for a config exported into a study folder (`STUDY/exported/`), the trial's Ray Train run `STUDY/train/trial_<id>/`;
- a run folder: a `lapstudy train` run `<storage>/<name>/` (config `<storage>/<name>.yaml`) or a study trial's
  `STUDY/train/trial_<id>/` (config `STUDY/trials/<id>.yaml`).
A checkpoint is a `state.pt` file (study/state.py), a Ray checkpoint folder holding one, or a run folder (its newest
`checkpoint_*`). The run's first stage is evaluated (the language model; later stages train other heads).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

import models
from study.data.text import Tokenizer, resolve_tokenizer
from study.errors import UserError
from study.evals.spec import check_evaluated_task
from study.runspec import load_run_spec, model_part
from study.yamlio import load_yaml

CHECKPOINT_FILE = "state.pt"  # study/state.py's (not imported: that module imports Ray)


def resolve_run(path: Path, checkpoint: Path | None = None) -> tuple[Path, Path]:
    """(run config, state.pt) for CONFIG_OR_RUN and an optional --checkpoint."""
    if not path.exists():
        raise UserError(f"CONFIG_OR_RUN: {path} does not exist (a run config .yaml or a run folder)")
    if path.is_dir():
        config = _config_of_run_folder(path)
        return config, _state_file(checkpoint or path)
    if checkpoint is not None:
        return path, _state_file(checkpoint)
    for candidate in _run_folders_of_config(path):
        if candidate.is_dir():
            return path, _state_file(candidate)
    raise UserError(f"--checkpoint: no checkpoint found for run config {path} (looked in "
                    f"{', '.join(str(c) for c in _run_folders_of_config(path))}); give --checkpoint PATH "
                    f"(a {CHECKPOINT_FILE}, a checkpoint_* folder or a run folder)")


def load_model(config: str | Path, checkpoint: str | Path | None = None, device: str | torch.device = "cpu"):
    """(GPT in eval mode with the checkpoint's weights, its Tokenizer, the RunSpec) of a run."""
    config_path, state_path = resolve_run(Path(config), Path(checkpoint) if checkpoint else None)
    spec = load_run_spec(config_path)
    check_evaluated_task(spec.task, f"run config {config_path}: task")
    model = trained_model(spec, config_path, state_path, device)
    tokenizer = tokenizer_for(spec.dataset, model.config.vocab_size, f"run config {config_path}")
    return model, tokenizer, spec


def trained_model(spec, config_path: Path, state_path: Path, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The run's model (its first stage's) in eval mode with the checkpoint's weights."""
    saved = torch.load(state_path, map_location=device, weights_only=False)
    state = saved.get("model", saved) if isinstance(saved, dict) else saved
    # The recorded model keys as they are (not resolved: a preset's defaults would hide the missing ones below).
    flat = model_part(spec.hyperparameters)
    if "wte.weight" in state:  # a GPT: the data fixes these; a config written before the data was opened may lack them
        flat.setdefault("vocab_size", state["wte.weight"].shape[0])
        flat.setdefault("context_length", getattr(spec.dataset, "seq_len", None) or 256)
    model = models.build_model(flat)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise UserError(f"--checkpoint: {state_path} does not fit the model of {config_path} (missing "
                        f"{sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})")
    return model.to(device).eval()


def tokenizer_for(dataset, vocab: int, where: str) -> Tokenizer:
    """The tokenizer a model trained on `dataset` reads (with the chat tokens where its vocabulary holds them)."""
    chat = bool(getattr(dataset, "chat_tokens", False))
    byte = dataclasses.replace(Tokenizer("byte"), chat=chat)
    if vocab == byte.vocab_size:
        return byte
    kind = getattr(dataset, "tokenizer", "byte")
    tokenizer = resolve_tokenizer("gpt2" if kind == "auto" else kind, getattr(dataset, "tokenizer_file", None))
    tokenizer = dataclasses.replace(tokenizer, chat=chat or tokenizer.chat)  # nanochat's always holds them
    if tokenizer.vocab_size > vocab:
        raise UserError(f"{where}: dataset.tokenizer {tokenizer.name} has {tokenizer.vocab_size} tokens but the model "
                        f"has vocab_size {vocab}")
    return tokenizer


def _state_file(path: Path) -> Path:
    if path.is_file():
        return path
    if (path / CHECKPOINT_FILE).is_file():
        return path / CHECKPOINT_FILE
    checkpoints = sorted(p for p in path.glob("checkpoint_*") if (p / CHECKPOINT_FILE).is_file())
    if not checkpoints:
        raise UserError(f"--checkpoint: {path} holds no {CHECKPOINT_FILE} and no checkpoint_* folder with one")
    return checkpoints[-1] / CHECKPOINT_FILE  # Ray names them checkpoint_000000, ...: the newest last


def _config_of_run_folder(folder: Path) -> Path:
    candidates = [folder.parent / f"{folder.name}.yaml"]
    if folder.name.startswith("trial_") and folder.parent.name == "train":
        candidates.append(folder.parent.parent / "trials" / f"{folder.name.removeprefix('trial_')}.yaml")
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise UserError(f"CONFIG_OR_RUN: no run config for run folder {folder} (looked for "
                    f"{', '.join(map(str, candidates))}); give the run config and --checkpoint {folder}")


def _run_folders_of_config(config: Path) -> list[Path]:
    folders = [config.parent / config.stem]
    try:
        trial_id = ((load_yaml(config, "run config") or {}).get("provenance") or {}).get("trial_id")
    except (UserError, AttributeError):  # not a run config: load_run_spec says why
        trial_id = None
    if trial_id:
        folders.append(config.parent.parent / "train" / f"trial_{trial_id}")
    return folders
