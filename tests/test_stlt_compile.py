"""The Triton kernels compiled for an NVIDIA Hopper GPU (sm_90) on a machine without one: every launch variant the op
can launch compiles, and none spills registers (models/stlt/triton_compile.py).

The variants come from the op itself (models/stlt/triton_op.py `launch_variants`: its forward and backward run with
the kernels replaced by a recorder), not from a list kept here; a test checks that arbitrary shapes launch nothing
outside them. Skipped, saying what is missing, only where Triton's NVIDIA backend or the ptxas it ships is absent.
About 106 variants in two worker processes: a minute or so on 2 cores with an empty Triton cache, seconds with a
warm one (TRITON_CACHE_DIR).
"""

import pytest

from models.stlt.triton_compile import compile_report, toolchain_missing
from models.stlt.triton_op import MAX_NODES, launch_variants, recorded_launches, run_forward_and_backward
from tests.stlt_fixtures import one_thread  # noqa: F401

MISSING = toolchain_missing()
pytestmark = [pytest.mark.triton, pytest.mark.slow(seconds=130)]  # 100 launch variants compiled
needs_toolchain = pytest.mark.skipif(MISSING is not None, reason=f"cannot compile for an NVIDIA GPU here: {MISSING}")


@pytest.fixture(scope="module")
def report():
    return compile_report(arch=90, workers=2)


def _describe(result: dict) -> str:
    return f"{result['kernel']} {result['constexprs']} num_warps={result['num_warps']}"


@needs_toolchain
def test_every_launch_variant_compiles_for_sm90(report):
    results = report["variants"]
    assert len(results) == len(launch_variants()) > 0
    failed = [f"{_describe(r)}: {r['error']}" for r in results if "error" in r]
    assert not failed, "\n".join(failed)


@needs_toolchain
def test_no_launch_variant_spills_registers(report):
    results = [r for r in report["variants"] if "error" not in r]
    spilled = [f"{_describe(r)}: {r['registers']} registers, {r['spill_stores']} bytes of spill stores, "
               f"{r['spill_loads']} of spill loads" for r in results if r["spill_stores"] or r["spill_loads"]]
    assert not spilled, "\n".join(spilled)
    assert all(0 < r["registers"] <= 255 for r in results)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize(("B", "N", "D", "S"), [(2, 1, 3, 1), (1, 70, 20, 5), (3, 200, 300, 33), (1, 129, 1024, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_the_op_launches_only_enumerated_variants(B, N, D, S, causal):
    """Lengths, widths and node counts that launch_variants() does not use launch only variants it found."""
    known = {(v["kernel"], tuple(v["constexprs"].items()), v["num_warps"]) for v in launch_variants()}
    with recorded_launches() as launched:
        run_forward_and_backward(B, N, D, S, causal=causal)
    assert launched and set(launched) <= known, set(launched) - known


def test_more_nodes_than_the_kernels_hold_are_refused():
    with pytest.raises(ValueError, match=f"^sigma: the triton backend takes up to {MAX_NODES} nodes"):
        with recorded_launches():
            run_forward_and_backward(1, 4, 2, MAX_NODES + 1, causal=True)
    with recorded_launches() as launched:
        run_forward_and_backward(1, 4, 2, MAX_NODES, causal=True)
    assert launched
