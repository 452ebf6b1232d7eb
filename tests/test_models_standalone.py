"""`models/` runs with torch and numpy alone (design.md, "Layout"): no pydantic, Ray, MLflow, Optuna or `study`.

Each check runs in a fresh interpreter whose first `sys.meta_path` finder refuses those packages (and their
submodules), so an import of any of them anywhere under `models/`, however indirect, fails the run. Uninstalling
them is not needed: the finder is asked before the installed packages are.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("pydantic", "ray", "mlflow", "optuna", "study")

HOOK = f"""
import importlib.abc
import sys

BLOCKED = {BLOCKED!r}


class RefuseStudyPackages(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"{{name}} is blocked: models/ must run on torch and numpy alone", name=name)
        return None


# A package imported before the hook (by a .pth file at start-up) would be served from sys.modules unseen.
preloaded = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
assert not preloaded, f"imported before the hook was installed: {{preloaded}}"
sys.meta_path.insert(0, RefuseStudyPackages())
"""


def _run(body: str) -> subprocess.CompletedProcess:
    script = HOOK + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_the_hook_refuses_every_study_package():
    # Without this, a hook that never fires would let the next test pass whatever models/ imports.
    result = _run(f"""
        refused = []
        for name in {BLOCKED!r} + ("pydantic.dataclasses", "ray.tune"):
            try:
                __import__(name)
            except ModuleNotFoundError as exc:
                assert "is blocked" in str(exc), exc
                refused.append(name)
        print(refused)
        assert len(refused) == {len(BLOCKED) + 2}, refused
    """)
    assert result.returncode == 0, result.stdout + result.stderr


def test_models_build_and_run_without_the_study_packages():
    result = _run("""
        import torch

        import models
        import models.geometry
        import models.stlt
        from models import build_model

        torch.manual_seed(0)
        vit = build_model({"preset": "vit_tiny_digits", "depth": 2, "mixer": "stlt", "stlt_nodes": 4})
        assert vit.mixer_kinds == ["stlt", "stlt"], vit.mixer_kinds
        out = vit(torch.randn(2, 1, 8, 8), return_features=True)
        assert out.logits.shape == (2, 10) and torch.isfinite(out.logits).all()
        split = models.geometry.variance_decomposition(out.tokens, torch.tensor([0, 1]))
        assert split["total_var"] > 0, split

        gpt = build_model({"preset": "gpt_tiny", "depth": 2, "k": 2})
        assert [block.mixer.laplacian_heads for block in gpt.blocks] == [2, 2]
        logits = gpt(torch.randint(0, 257, (2, 16)))
        assert logits.shape == (2, 16, 257) and torch.isfinite(logits).all()

        leaked = sorted(m for m in sys.modules if m.partition(".")[0] in BLOCKED)
        assert not leaked, leaked
        print("models ran standalone")
    """)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "models ran standalone" in result.stdout
