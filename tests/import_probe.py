"""What importing one module brings with it, seen from a fresh interpreter (the test process has imported much more)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def imported_with(module: str, candidates: tuple[str, ...]) -> list[str]:
    """The names among `candidates` that `import module` loads into a fresh interpreter, in order."""
    probe = f"import sys, {module}; print(','.join(m for m in {candidates!r} if m in sys.modules))"
    loaded = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    return [name for name in loaded.stdout.strip().split(",") if name]
