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


def imported_by_command(argv: list[str], candidates: tuple[str, ...]) -> tuple[int, list[str]]:
    """(exit code, the names among `candidates` loaded) of `lapstudy ARGV` run by `study.cli.main` in a fresh
    interpreter; its own output is discarded."""
    probe = (f"import contextlib, io, sys\nfrom study.cli import main\n"
             f"with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
             f"    try:\n        code = main({argv!r})\n    except SystemExit as exit_:\n        code = exit_.code\n"
             f"print(code, ','.join(m for m in {candidates!r} if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    code, _, loaded = done.stdout.strip().splitlines()[-1].partition(" ")
    return int(code), [name for name in loaded.split(",") if name]
