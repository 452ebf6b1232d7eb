"""STLT mix: the fast paths against the write-up's per-token loop and against SDPA attention of the same width.

Forward + backward of the core op (gradients for x, sigma, omega, T, C and the mask), measured side by side in one
run; prints one JSON object.

CPU (default; D = 256, S = 32, B = 1; "bilateral" is the ViT case, one mask per sequence, "causal" the GPT's, a
mask per position from the prefix-pooled gate). Every figure is a median over ``--repeats`` interleaved rounds, with
its range; a ratio of two cases is the ratio of their medians, with the range of the per-round ratios. The torch
path takes the algorithm measured fastest at each length (models/stlt/op.py FASTEST_FROM_N; ``torch_algorithms``
says which ran); ``--calibrate`` remeasures that table.
- ``speedup_vs_loop_4096``: the write-up's per-token ``bilateral_scan`` loop (seed 003; its in-place writes replaced
  by a list and one stack, which only helps it: autograd of ``buf[:, n] = state`` copies the whole buffer at every
  step) over the torch path at N = 4096. Target >= 100.
- ``scaling_16384_over_4096`` and ``_causal``: t(16384) / t(4096). Target <= 4.4 (linear: 4; N log N alone gives
  4.6, so at 16k the path must be linear and no slower per position than the FFT convolution at 4k).
- ``causal_over_bilateral_4096``: the causal path over the bilateral one at N = 4096. Target <= 2.
- ``crossover_n`` and ``_causal``: the smallest N from which the torch path beats SDPA attention (4 heads of 64; no
  mask, or causal) at every measured N. Target <= 2048.
- ``minor_page_faults_per_call``: median minor page faults of one call in the scaling comparisons (fresh pages,
  after the allocator handed freed memory back to the kernel): whether a run's 16k figures include that cost.
- ``triton_sm90``: registers per thread and spill bytes of every launch variant of the Triton kernels, compiled for
  sm_90 at 4 warps with Triton's compiler and ptxas, no GPU needed (tests/test_stlt_compile.py: none spills).
On a shared machine, ``--threads 1`` keeps other processes from stalling intra-op thread hand-offs.

CUDA (``--device cuda``; B = 4, D = 1024, S = 32): the Triton kernels against SDPA (16 heads of 64, bf16 and fp32)
at N = 4k..32k, with achieved FLOP/s and memory bandwidth against the GPU's peaks. Target: >= 5x SDPA at 32k.
FLOPs and bytes of the STLT kernels are counted from what the kernels execute (models/stlt/triton_kernels.py),
SDPA's from its matmuls (forward 4 B N^2 D, backward 2.5x forward, as flash attention recomputes scores).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import time

import torch
import torch.nn.functional as F

from models.stlt import op, stlt_mix

S_NODES = 32


def make_stlt_inputs(B, N, D, device, *, per_position: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, D, generator=g)
    sigma = torch.logspace(-3, 1, S_NODES)
    omega = torch.rand(S_NODES, generator=g) * math.pi
    T = torch.tensor(max(4.0, N / 16))
    C = torch.complex(torch.randn(S_NODES, D, generator=g), torch.randn(S_NODES, D, generator=g)) / S_NODES
    mask = torch.rand((B, N, S_NODES) if per_position else (B, S_NODES), generator=g)
    return [t.to(device).requires_grad_() for t in (x, sigma, omega, T, C, mask)]


def stlt_case(B, N, D, device, *, causal: bool, backend: str = "auto"):
    inputs = make_stlt_inputs(B, N, D, device, per_position=causal)

    def run():
        y = stlt_mix(*inputs, causal=causal, backend=backend)
        torch.autograd.grad(y.sum(), inputs)

    return run


def write_up_loop_case(B, N, D):
    """The write-up's bilateral_scan: one Python step per token and direction over (B, S, D) complex states, the
    window folded into the decay as the design says, then the masked readout by C."""
    x, sigma, omega, T, C, mask = make_stlt_inputs(B, N, D, "cpu", per_position=False)

    def bilateral_scan(x, s, T, delta_t=1.0):
        decay = torch.exp(-(s + 1 / T) * delta_t)[:, None]  # (S, 1), window included
        state = torch.zeros(x.shape[0], len(s), x.shape[2], dtype=torch.complex64)
        forward = []
        for n in range(x.shape[1]):
            state = state * decay + x[:, n, None]
            forward.append(state)
        state = torch.zeros_like(state)
        backward = [None] * x.shape[1]
        for n in reversed(range(x.shape[1])):
            state = state * decay + x[:, n, None]
            backward[n] = state
        return torch.stack(forward, 1) + torch.stack(backward, 1) - x[:, :, None]

    def run():
        s = torch.complex(sigma, omega)
        L = bilateral_scan(x, s, T)
        y = torch.einsum("bk,bnkd->bnd", mask, (C * L).real)
        torch.autograd.grad(y.sum(), [x, sigma, omega, T, C, mask])

    return run


def sdpa_case(B, N, D, heads, device, dtype=torch.float32, causal: bool = False):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, heads, N, D // heads, generator=g).to(device, dtype).requires_grad_() for _ in range(3))

    def run():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.autograd.grad(out.sum(), [q, k, v])

    return run


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def interleaved_samples(cases: dict, device: str, repeats: int) -> dict[str, list[float]]:
    """Seconds per call of each case, `repeats` rounds run round-robin so drifts in machine load hit all alike."""
    for fn in cases.values():
        fn()
    samples = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            sync(device)
            start = time.perf_counter()
            fn()
            sync(device)
            samples[name].append(time.perf_counter() - start)
    return samples


def counting_faults(fn, counts: list):
    """fn, appending the minor page faults of each call to `counts`: memory the allocator handed back to the kernel
    and takes again costs a fault per 4 KiB page touched, which 16k calls may pay (their tensors are 16 MB each)."""

    def run():
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        fn()
        counts.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    return run


def interleaved_medians(cases: dict, device: str, repeats: int) -> dict[str, float]:
    return {name: statistics.median(v) for name, v in interleaved_samples(cases, device, repeats).items()}


def spread(values: list[float], digits: int = 5) -> dict:
    """Median and range of repeated measurements."""
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def ratio(samples: dict, top: str, bottom: str) -> dict:
    """samples[top] / samples[bottom]: the ratio of medians, and the range of the per-round ratios (each round runs
    both cases back to back, so a round's ratio sees one machine state)."""
    rounds = [a / b for a, b in zip(samples[top], samples[bottom])]
    return {"value": round(statistics.median(samples[top]) / statistics.median(samples[bottom]), 2),
            "rounds_min": round(min(rounds), 2), "rounds_max": round(max(rounds), 2)}


def target(measured: dict, text: str, met: bool) -> dict:
    return {**measured, "target": text, "met": met}


def cpu_report(repeats: int) -> dict:
    D, B = 256, 1
    report = {"device": "cpu", "threads": torch.get_num_threads(), "D": D, "S": S_NODES, "B": B,
              "repeats": repeats}
    report["torch_algorithms"] = {f"{kind}_{n}": op.torch_algorithm(n, per_position=kind == "causal",
                                                                     causal=kind == "causal")
                                  for kind in ("bilateral", "causal") for n in (4096, 16384)}
    # Each comparison interleaves only its own cases: a huge case between two small ones evicts their caches and
    # returns their pages, which would bill the small ones for the big one.
    loop_run, fast_run = write_up_loop_case(B, 4096, D), stlt_case(B, 4096, D, "cpu", causal=False)
    write_up_loop_case(B, 64, D)()  # warm-up of the loop's ops
    loop = interleaved_samples({"write_up_loop_4096": loop_run, "torch_4096": fast_run}, "cpu", 2)
    at_4096 = interleaved_samples({"bilateral": fast_run, "causal": stlt_case(B, 4096, D, "cpu", causal=True)},
                                  "cpu", repeats)
    faults = {}
    bilateral = interleaved_samples({n: counting_faults(stlt_case(B, n, D, "cpu", causal=False),
                                                        faults.setdefault(f"torch_bilateral_{n}", []))
                                     for n in (4096, 16384)}, "cpu", repeats)
    causal = interleaved_samples({n: counting_faults(stlt_case(B, n, D, "cpu", causal=True),
                                                     faults.setdefault(f"torch_causal_{n}", []))
                                  for n in (4096, 16384)}, "cpu", repeats)
    report["seconds"] = {
        "write_up_loop_4096": spread(loop["write_up_loop_4096"], 4),
        "torch_bilateral_4096": spread(at_4096["bilateral"]),
        "torch_causal_4096": spread(at_4096["causal"]),
        "torch_bilateral_16384": spread(bilateral[16384]),
        "torch_causal_16384": spread(causal[16384]),
    }
    report["minor_page_faults_per_call"] = {name: int(statistics.median(counts)) for name, counts in faults.items()}
    vs_loop = ratio(loop, "write_up_loop_4096", "torch_4096")
    scaling, scaling_causal = ratio(bilateral, 16384, 4096), ratio(causal, 16384, 4096)
    causal_over_bilateral = ratio(at_4096, "causal", "bilateral")

    crossover = {}
    for n in (256, 512, 1024, 2048, 4096):
        t = interleaved_samples({"stlt": stlt_case(B, n, D, "cpu", causal=False),
                                 "sdpa": sdpa_case(B, n, D, 4, "cpu"),
                                 "stlt_causal": stlt_case(B, n, D, "cpu", causal=True),
                                 "sdpa_causal": sdpa_case(B, n, D, 4, "cpu", causal=True)}, "cpu", repeats)
        crossover[n] = t
    report["vs_sdpa_seconds"] = {str(n): {name: spread(v) for name, v in t.items()} for n, t in crossover.items()}
    crossovers = {}
    for key, name, rival in (("bilateral", "stlt", "sdpa"), ("causal", "stlt_causal", "sdpa_causal")):
        faster = [n for n, t in crossover.items() if statistics.median(t[name]) < statistics.median(t[rival])]
        # The smallest N from which STLT wins at every larger measured N (None if it never does), and the range of
        # the per-round ratios STLT / SDPA there.
        first = next((n for n in crossover if all(m in faster for m in crossover if m >= n)), None)
        crossovers[key] = {"value": first,
                           "stlt_over_sdpa": ratio(crossover[first], name, rival) if first else None}
    report["targets"] = {
        "speedup_vs_loop_4096": target(vs_loop, ">= 100", vs_loop["value"] >= 100),
        "scaling_16384_over_4096": target(scaling, "<= 4.4", scaling["value"] <= 4.4),
        "scaling_16384_over_4096_causal": target(scaling_causal, "<= 4.4", scaling_causal["value"] <= 4.4),
        "causal_over_bilateral_4096": target(causal_over_bilateral, "<= 2", causal_over_bilateral["value"] <= 2),
        **{name: target(crossovers[kind], "<= 2048", crossovers[kind]["value"] is not None
                        and crossovers[kind]["value"] <= 2048)
           for name, kind in (("crossover_n", "bilateral"), ("crossover_n_causal", "causal"))},
    }
    report["triton_sm90"] = triton_compile_report()
    return report


def triton_compile_report() -> dict:
    """Registers and spills of every launch variant of the Triton kernels compiled for sm_90 (no GPU needed;
    models/stlt/triton_compile.py): per kernel, and each variant at the default 32 nodes."""
    from models.stlt.triton_compile import compile_report, toolchain_missing

    missing = toolchain_missing()
    if missing:
        return {"skipped": missing}
    report = compile_report(arch=90, workers=2)
    variants = [v for v in report["variants"] if "error" not in v]
    kernels = {}
    for name in sorted({v["kernel"] for v in report["variants"]}):
        mine = [v for v in variants if v["kernel"] == name]
        kernels[name] = {
            "variants": sum(v["kernel"] == name for v in report["variants"]),
            "failed": sum(v["kernel"] == name and "error" in v for v in report["variants"]),
            "registers": [min(v["registers"] for v in mine), max(v["registers"] for v in mine)] if mine else None,
            "spill_bytes": sum(v["spill_stores"] + v["spill_loads"] for v in mine),
            "at_32_nodes": {_variant_label(v): v["registers"] for v in mine if v["constexprs"]["BLOCK_S"] == 32},
        }
    return {"arch": report["arch"], "num_warps": sorted({v["num_warps"] for v in report["variants"]}),
            "variants": len(report["variants"]), "seconds": report["seconds"], "kernels": kernels}


def _variant_label(variant: dict) -> str:
    flags = {k: v for k, v in variant["constexprs"].items() if k not in ("BLOCK_S", "CHUNK")}
    return " ".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in flags.items())


CALIBRATION_N = (64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def calibrate(repeats: int) -> dict:
    """Every torch algorithm at CALIBRATION_N, per mask kind and direction (B = 1, D = 256, S = 32), and the table of
    where each is fastest (models/stlt/op.py FASTEST_FROM_N). An algorithm more than 4x slower than the fastest at one
    length is not timed at longer ones (the per-node FFT convolution would take minutes at 16k)."""
    D, B = 256, 1
    seconds, table = {}, {}
    for mask_kind in ("sequence", "position"):
        for direction in ("bilateral", "causal"):
            key = f"{mask_kind}_{direction}"
            candidates, rows = list(op.TORCH_ALGORITHMS), {}
            for n in CALIBRATION_N:
                inputs = make_stlt_inputs(B, n, D, "cpu", per_position=mask_kind == "position")
                cases = {name: _algorithm_case(op.TORCH_ALGORITHMS[name], inputs, direction == "causal")
                         for name in candidates}
                medians = interleaved_medians(cases, "cpu", repeats)
                rows[n] = {name: round(t, 6) for name, t in medians.items()}
                best = min(medians.values())
                candidates = [name for name in candidates if medians[name] <= 4 * best]
            seconds[key] = {str(n): row for n, row in rows.items()}
            table[mask_kind, direction] = op.fastest_from_n(rows)
    return {"seconds": seconds,
            "FASTEST_FROM_N": {f"{kind}, {direction}": entries for (kind, direction), entries in table.items()}}


def _algorithm_case(fn, inputs, causal: bool):
    def run():
        y = fn(*inputs, causal=causal)
        torch.autograd.grad(y.sum(), inputs)

    return run


# Dense peaks of GPUs we expect to meet: (fp32 FLOP/s without tensor cores, bf16 tensor-core FLOP/s, HBM bytes/s).
GPU_PEAKS = {
    "H200": (67e12, 989e12, 4.8e12),
    "H100 SXM": (67e12, 989e12, 3.35e12),
    "H100 PCIe": (51e12, 756e12, 2.0e12),
    "A100": (19.5e12, 312e12, 2.0e12),
    "L40S": (91.6e12, 362e12, 0.864e12),
    "A10": (31.2e12, 125e12, 0.6e12),
}


def gpu_peaks(name: str):
    for key in sorted(GPU_PEAKS, key=len, reverse=True):
        if all(part in name for part in key.split()):
            return key, GPU_PEAKS[key]
    return None, None


def stlt_kernel_work(B, N, D, S, chunk=64):
    """FLOPs and bytes the Triton kernels execute for one bilateral forward + backward with a per-sequence mask.

    Per (position, node, channel): an order-1 scan step is 8 FLOPs (complex multiply-add), order 2 is 16; the fused
    forward readout 4, the backward readout (dx, dC, d log a accumulation) 12; each scan runs twice (chunk states,
    then the rescan). Bytes: every pass reads its (B, N, D) inputs and writes its (B, N, D) output once, plus the
    chunk states (B, N/chunk, S, D, components) written and read three times."""
    elems = B * N * S * D
    fwd = 2 * (2 * 8 + 4) * elems
    bwd = 2 * (2 * 16 + 12) * elems + 2 * (2 * 8 + 4) * elems
    token_bytes = B * N * D * 4
    state_bytes = lambda comps: B * math.ceil(N / chunk) * S * D * comps * 4 * 3  # noqa: E731
    fwd_bytes = 2 * (2 * token_bytes + state_bytes(2))
    bwd_bytes = 2 * (3 * token_bytes + state_bytes(4) + state_bytes(2)) + 2 * (3 * token_bytes + state_bytes(2))
    return fwd + bwd, fwd_bytes + bwd_bytes


def cuda_report(repeats: int) -> dict:
    B, D, S, heads = 4, 1024, S_NODES, 16
    name = torch.cuda.get_device_name()
    peak_name, peaks = gpu_peaks(name)
    report = {"device": name, "peaks_from": peak_name, "B": B, "D": D, "S": S, "heads": heads, "shapes": {}}
    for n in (4096, 8192, 16384, 32768):
        t = interleaved_medians({"stlt_triton": stlt_case(B, n, D, "cuda", causal=False, backend="triton"),
                                 "sdpa_bf16": sdpa_case(B, n, D, heads, "cuda", torch.bfloat16),
                                 "sdpa_fp32": sdpa_case(B, n, D, heads, "cuda", torch.float32)}, "cuda", repeats)
        stlt_flops, stlt_bytes = stlt_kernel_work(B, n, D, S)
        sdpa_flops = 3.5 * 4 * B * n * n * D
        entry = {
            "seconds": {k: round(v, 6) for k, v in t.items()},
            "speedup_vs_sdpa_bf16": round(t["sdpa_bf16"] / t["stlt_triton"], 2),
            "speedup_vs_sdpa_fp32": round(t["sdpa_fp32"] / t["stlt_triton"], 2),
            "stlt_tflops": round(stlt_flops / t["stlt_triton"] / 1e12, 2),
            "stlt_bandwidth_tb_s": round(stlt_bytes / t["stlt_triton"] / 1e12, 3),
            "sdpa_bf16_tflops": round(sdpa_flops / t["sdpa_bf16"] / 1e12, 1),
        }
        if peaks:
            entry["stlt_fraction_of_fp32_peak"] = round(stlt_flops / t["stlt_triton"] / peaks[0], 3)
            entry["stlt_fraction_of_bandwidth_peak"] = round(stlt_bytes / t["stlt_triton"] / peaks[2], 3)
            entry["sdpa_bf16_fraction_of_peak"] = round(sdpa_flops / t["sdpa_bf16"] / peaks[1], 3)
        report["shapes"][str(n)] = entry
    speedup = report["shapes"]["32768"]["speedup_vs_sdpa_bf16"]
    report["targets"] = {"speedup_vs_sdpa_bf16_32k": {"value": speedup, "target": ">= 5", "met": speedup >= 5}}
    return report


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--calibrate", action="store_true",
                        help="time every torch algorithm by length and print the table of models/stlt/op.py")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.calibrate:
        report = calibrate(args.repeats)
    else:
        report = cuda_report(args.repeats) if args.device == "cuda" else cpu_report(args.repeats)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
