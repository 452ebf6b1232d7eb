"""The Triton kernels compiled for an NVIDIA GPU on a machine without one: registers and spills per launch variant.

Every variant the op launches (triton_op.launch_variants) goes through Triton's compiler to PTX for the target
architecture, then through the ptxas that ships with Triton (`ptxas-blackwell`: the plain `ptxas` beside it is an
older CUDA's and refuses the PTX of recent Tritons), whose `-v` report gives registers per thread and spill bytes.

    python -m models.stlt.triton_compile [--arch 90] [--workers 2]       one JSON object on stdout

`compile_report()` runs that command in a process of its own: the kernels must be defined with TRITON_INTERPRET
unset (tests set it on machines without a GPU), and the variants compile in parallel worker processes. Triton caches
its compilations (TRITON_CACHE_DIR, ~/.triton/cache by default), and the ptxas reports are cached beside them by the
hash of their PTX, so a second run costs seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

# The options Triton's own compile passes to this ptxas (triton/backends/nvidia/compiler.py, make_cubin), so that the
# counts are those of the cubin Triton loads: without --regAllocOptLevel=2, ptxas allocates registers differently
# (some variants then spill a few bytes that Triton's cubin does not).
PTXAS_OPTIONS = ("-lineinfo", "--regAllocOptLevel=2")


def toolchain_missing() -> str | None:
    """Why the kernels cannot be compiled here (Triton, its NVIDIA backend or its ptxas absent), or None."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    if importlib.util.find_spec("triton.backends.nvidia.compiler") is None:
        return "Triton's NVIDIA backend is not installed"
    ptxas = ptxas_path()
    if not os.access(ptxas, os.X_OK):
        return f"Triton's ptxas is absent ({ptxas})"
    return None


def ptxas_path() -> Path:
    spec = importlib.util.find_spec("triton")
    return Path(spec.origin).parent / "backends" / "nvidia" / "bin" / "ptxas-blackwell"


def compile_report(arch: int = 90, workers: int = 2, timeout: float = 600) -> dict:
    """Compile every launch variant for sm_`arch` in a fresh process; its JSON report (see main)."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[2]
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-m", "models.stlt.triton_compile", "--arch", str(arch),
                             "--workers", str(workers)], env=env, cwd=root, capture_output=True, text=True,
                            timeout=timeout)
    if result.returncode != 0:
        raise RuntimeError(f"compiling the STLT kernels failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout)


def compile_variant(variant: dict, arch: int) -> dict:
    """One launch variant compiled for sm_`arch`: the variant with its registers, spill bytes and compile seconds, or
    the error its compilation raised."""
    started = time.perf_counter()
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource

        from models.stlt import triton_kernels

        kernel = getattr(triton_kernels, variant["kernel"])
        names = kernel.arg_names
        signature = dict(zip(names, variant["signature"]))
        signature.update({name: "constexpr" for name in variant["constexprs"]})
        constexprs = {(names.index(name),): value for name, value in variant["constexprs"].items()}
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                                  target=GPUTarget("cuda", arch, 32), options={"num_warps": variant["num_warps"]})
        usage = _ptxas_usage(compiled.asm["ptx"], arch)
    except Exception as error:  # reported per variant, so one failure does not hide the others
        return {**variant, "error": f"{type(error).__name__}: {error}"}
    return {**variant, **usage, "seconds": round(time.perf_counter() - started, 2)}


def _ptxas_usage(ptx: str, arch: int) -> dict:
    gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    cache = Path(os.environ.get("TRITON_CACHE_DIR", Path.home() / ".triton" / "cache")) / "stlt_ptxas"
    cached = cache / f"{hashlib.sha256((gpu + ptx).encode()).hexdigest()}.txt"
    if cached.exists():
        log = cached.read_text()
    else:
        with tempfile.TemporaryDirectory() as work:
            source = Path(work) / "kernel.ptx"
            source.write_text(ptx)
            result = subprocess.run([str(ptxas_path()), *PTXAS_OPTIONS, "-v", f"--gpu-name={gpu}", str(source),
                                     "-o", str(Path(work) / "kernel.cubin")], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"ptxas: {result.stderr.strip()[-2000:]}")
        log = result.stderr
        cache.mkdir(parents=True, exist_ok=True)
        cached.write_text(log)
    return {"registers": _number(r"Used (\d+) registers", log),
            "spill_stores": _number(r"(\d+) bytes spill stores", log),
            "spill_loads": _number(r"(\d+) bytes spill loads", log),
            "stack_frame": _number(r"(\d+) bytes stack frame", log)}


def _number(pattern: str, text: str) -> int:
    match = re.search(pattern, text)
    if match is None:
        raise RuntimeError(f"ptxas -v printed no {pattern!r}:\n{text}")
    return int(match.group(1))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: Hopper)")
    parser.add_argument("--workers", type=int, default=2, help="compiling processes")
    args = parser.parse_args()
    reason = toolchain_missing()
    if reason:
        raise SystemExit(reason)
    from models.stlt.triton_op import launch_variants

    started = time.perf_counter()
    variants = launch_variants()
    # Spawned workers: each defines the kernels afresh, and none inherits a forked torch thread pool.
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        results = list(pool.map(compile_variant, variants, [args.arch] * len(variants)))
    print(json.dumps({"arch": f"sm_{args.arch}", "workers": args.workers,
                      "seconds": round(time.perf_counter() - started, 1), "variants": results}))


if __name__ == "__main__":
    main()
