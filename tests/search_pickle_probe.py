"""The searcher of each sampler kind through Ray's cloudpickle and back, as Ray Tune pickles it when the Tuner is built
and into the study's state for `--resume`: the copy goes on suggesting and recording trials in the same Optuna study.

Imported by tests/test_search_pickle.py under the installed Optuna, and run as a script (`python
tests/search_pickle_probe.py KIND...`) under another Optuna put first on PYTHONPATH."""

from __future__ import annotations

import math
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # as a script: fault_fixtures beside it

import optuna  # noqa: E402
import ray.cloudpickle  # noqa: E402
from optuna.storages import JournalStorage  # noqa: E402
from optuna.storages.journal import JournalFileBackend  # noqa: E402

from fault_fixtures import tiny_space  # noqa: E402
from study.search import JOURNAL_FILE, make_searcher  # noqa: E402
from study.space import parse_space  # noqa: E402

KINDS = ("tpe", "random", "grid", "cmaes", "nsga2")  # study/space.py's Sampler.kind
LR, K = (1.0e-4, 1.0e4), (0, 4)  # tiny_space's parameters: lr log-uniform, k an int
TRIALS_EACH_SIDE = 4
POPULATION = 2  # NSGA-II: the copy's trials are of later generations, bred from the original's


def space_of(kind: str):
    changes = {"sampler": {"kind": kind, "n_startup_trials": 1} if kind in ("tpe", "cmaes") else {"kind": kind},
               "points_to_evaluate": []}
    if kind == "grid":  # a grid needs categorical or int parameters: 2 x 5 configurations
        changes["parameters"] = {"lr": [1.0e-3, 1.0e-2], "k": {"type": "int", "low": K[0], "high": K[1]}}
    if kind == "nsga2":  # NSGA-II is what multi-objective studies use
        changes.update(metric=["val_acc", "val_loss"], mode=["max", "min"],
                       sampler={"kind": "nsga2", "population_size": POPULATION})
    return parse_space(tiny_space(**changes))


def objectives(config: dict) -> dict:
    """A value for each metric that depends on the configuration (so model-based samplers have a signal)."""
    distance = abs(math.log10(config["lr"]) + 2.0) + abs(config["k"] - 2)
    return {"val_acc": 1.0 / (1.0 + distance), "val_loss": distance}


def run_trials(searcher, prefix: str, count: int) -> list[dict]:
    configs = []
    for i in range(count):
        config = searcher.suggest(f"{prefix}{i}")
        assert isinstance(config, dict), (prefix, i, config)
        searcher.on_trial_complete(f"{prefix}{i}", {**objectives(config), "epoch": searcher.epochs})  # ran in full
        configs.append({"lr": config["lr"], "k": config["k"]})
    return configs


def check_round_trip(kind: str, folder: Path) -> None:
    space = space_of(kind)
    original = make_searcher(space, seed=0, folder=folder)
    original.set_search_properties(None, None, {})
    before = run_trials(original, "before", TRIALS_EACH_SIDE)
    copy = ray.cloudpickle.loads(ray.cloudpickle.dumps(original))
    after = run_trials(copy, "after", TRIALS_EACH_SIDE)

    sampler = copy.searcher._ot_study.sampler
    assert type(sampler) is type(original.searcher._ot_study.sampler), kind
    for config in before + after:
        assert LR[0] <= config["lr"] <= LR[1] and K[0] <= config["k"] <= K[1] and isinstance(config["k"], int)
    study = optuna.load_study(study_name=space.name,
                              storage=JournalStorage(JournalFileBackend(str(folder / JOURNAL_FILE))))
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert [t.params for t in complete] == before + after, kind  # the copy records where the original did
    if kind == "grid":  # the copy goes on through the grid: no configuration twice
        assert len({(c["lr"], c["k"]) for c in before + after}) == len(before + after)
    if kind == "nsga2":  # the copy bred later generations, through the generation cache its fresh lock guards
        generations = [t.system_attrs["NSGAIISampler:generation"] for t in complete[TRIALS_EACH_SIDE:]]
        assert max(generations) >= 1, generations


if __name__ == "__main__":
    for kind in sys.argv[1:]:
        with tempfile.TemporaryDirectory() as folder:
            check_round_trip(kind, Path(folder))
    print(f"optuna {optuna.__version__}: {' '.join(sys.argv[1:])}")
