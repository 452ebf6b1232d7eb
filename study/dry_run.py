"""`lapstudy run SPACE --dry-run`: what a study would train, without starting Ray or reading data.

After study/precheck.py's checks, each configuration the study would run (every grid point; for another sampler
the extreme configurations it samples between) is resolved as its trial resolves it (`SearchSpace.planned_stages`:
the model keys each stage's data fixes in advance, steps from param_data_ratio on the model built) and printed stage
by stage: the model (parameters counted on the meta device, vocabulary, Laplacian heads per layer, mixers) and the
epochs, steps, batch and clipping it trains with, under the workers the command line gives each trial.
"""

from __future__ import annotations

import itertools

from study.errors import UserError
from study.precheck import RunOptions
from study.space import SearchSpace
from study.space_corners import corner_configs


def configurations(space: SearchSpace) -> tuple[str, list[dict]]:
    """(what they are, the sampled values): the grid's points, or the space's extreme configurations."""
    if space.sampler.kind == "grid":
        grid = space.grid()
        return "grid points", [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    return (f"extreme configurations ({space.sampler.kind} samples between them)",
            [sampled for sampled, _ in corner_configs(space)])


def _model_line(resolved) -> str:
    import models

    model_config, config = resolved.model, resolved.config
    params = models.count_parameters(models.build_model(config, device="meta"))
    parts = [f"{params:,} parameters", f"model {model_config['model']}"]
    if "vocab_size" in model_config:
        parts.append(f"vocabulary {model_config['vocab_size']:,}")
    parts.append(f"Laplacian heads per layer {config.laplacian_counts}")
    kinds = sorted(set(config.mixer_kinds))
    parts.append(f"mixers {kinds[0] if len(kinds) == 1 else config.mixer_kinds}")
    return ", ".join(parts)


def _stage_lines(name: str | None, spec) -> list[str]:
    train = spec.train
    steps = f"{train.steps_per_epoch:,} steps" if train.steps_per_epoch else "all the data"
    dataset = spec.dataset
    data = dataset.source + (f", tokenizer {dataset.tokenizer}" if hasattr(dataset, "tokenizer") else "")
    clip = f"grad_clip {train.grad_clip}" if train.grad_clip > 0 else "no gradient clipping"
    return [f"  {name or 'first stage'} ({spec.task}, data {data}): {spec.epochs} epoch(s) x {steps}, batch "
            f"{train.batch_size}, {clip}",
            f"    {_model_line(spec.resolved)}"]


def describe_study(space: SearchSpace, name: str, options: RunOptions) -> str:
    """The text `--dry-run` prints."""
    what, points = configurations(space)
    num_samples = options.num_samples or space.default_num_samples()
    seeds = space.replicate_seeds(space.seed if options.seed is None else options.seed)
    resources = options.resources
    lines = [f"study {name}: task {space.task}, {num_samples} configuration(s) x {len(seeds)} seed(s) {seeds}, "
             f"early stopping {space.early_stopping.kind}, {space.total_epochs} epochs in all",
             f"each trial: {resources.workers} worker(s), {resources.cpus_per_worker:g} CPU and "
             f"{resources.gpus_per_worker:g} GPU each",
             f"{len(points)} {what}:"]
    for i, sampled in enumerate(points):
        lines.append(f"{i}: {sampled}")
        try:
            for stage_name, spec in space.planned_stages(space.resolve(sampled)):
                lines += _stage_lines(stage_name, spec)
        except UserError as exc:  # a key only the data decides (an image source's classes, say)
            lines.append(f"  resolved when its data is read: {exc}")
    lines.append("dry run: nothing started, no data read")
    return "\n".join(lines)
