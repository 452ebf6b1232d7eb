"""Laplacian-head attention: cost of k Laplacian heads, and the fused path against the materialised formulation.

Measured side by side in one run on the same shapes (a ViT-B block: dim 768, 12 heads; N = 197 and N = 1024;
forward + backward). Prints one JSON object:

- ``k_ratio``: throughput(k=12) / throughput(k=0) of the fast path (core op and whole block); target >= 0.98.
  Repeats are interleaved and medians reported, since the effect is smaller than the machine's noise.
- ``speedup_vs_materialised``: time of the materialised-softmax formulation of seed 000 section 2 (per head
  ``P = softmax(QK^T/sqrt(d))``, ``PV`` or ``V - PV``, concatenated, then W_o) over the fast path's, for the
  core op and the whole block; target >= 3x for the core op at N = 1024 on CPU.
- ``peak_memory_mb``: peak memory of one forward + backward of each (after a warm-up call), and their ratio. On CPU
  it is the peak resident set above the resident set before the call, in a fresh process whose large allocations
  are all mmapped (so freed memory leaves the resident set); on CUDA ``torch.cuda.max_memory_allocated``.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from models.attention import MixedHeadAttention
from models.block import Block

DIM, HEADS = 768, 12


class MaterialisedAttention(nn.Module):
    """The write-up's formulation: a loop over heads, each materialising its N x N attention matrix."""

    def __init__(self, dim: int, num_heads: int, laplacian_heads: int):
        super().__init__()
        self.num_heads, self.head_dim, self.laplacian_heads = num_heads, dim // num_heads, laplacian_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.core(*self.qkv(x).chunk(3, dim=-1)))

    def core(self, q, k, v):
        heads = []
        for h in range(self.num_heads):
            cols = slice(h * self.head_dim, (h + 1) * self.head_dim)
            attn = torch.softmax(q[..., cols] @ k[..., cols].transpose(-2, -1) / math.sqrt(self.head_dim), dim=-1)
            out = attn @ v[..., cols]
            heads.append(v[..., cols] - out if h < self.laplacian_heads else out)
        return torch.cat(heads, dim=-1)


def fused_core(q, k, v, laplacian_heads: int) -> torch.Tensor:
    """The fast path's core op on (B, N, D) inputs, as MixedHeadAttention runs it."""
    B, N, D = q.shape
    split = lambda t: t.view(B, N, HEADS, D // HEADS).transpose(1, 2)  # noqa: E731
    q, k, v = split(q), split(k), split(v)
    o = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    if laplacian_heads:
        v = v.transpose(1, 2)
        o = torch.cat((v[:, :, :laplacian_heads] - o[:, :, :laplacian_heads], o[:, :, laplacian_heads:]), dim=2)
    return o.reshape(B, N, D)


def make_case(kind: str, impl: str, k: int, batch: int, n: int, device: str):
    """A closure running one forward + backward of the named case on fresh inputs of the given shape."""
    torch.manual_seed(0)
    x = torch.randn(batch, n, DIM, device=device, requires_grad=True)
    if kind == "core":
        q, kk, v = (torch.randn(batch, n, DIM, device=device, requires_grad=True) for _ in range(3))
        materialised = MaterialisedAttention(DIM, HEADS, k).to(device)
        op = (lambda: fused_core(q, kk, v, k)) if impl == "fast" else (lambda: materialised.core(q, kk, v))
        return lambda: op().sum().backward()
    mixer = MixedHeadAttention(DIM, HEADS, laplacian_heads=k, qkv_bias=True) if impl == "fast" else \
        MaterialisedAttention(DIM, HEADS, k)
    block = Block(DIM, mixer, layer_scale_init=1e-4).to(device)
    return lambda: block(x).sum().backward()


def sync(device: str):
    if device == "cuda":
        torch.cuda.synchronize()


def time_once(fn, device: str) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def interleaved_medians(cases: dict, device: str, repeats: int) -> dict[str, float]:
    """Median seconds per call of each case, the cases run round-robin so drifts in machine load hit all alike."""
    for fn in cases.values():  # warm-up
        fn()
    samples = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            samples[name].append(time_once(fn, device))
    return {name: statistics.median(times) for name, times in samples.items()}


def _proc_status_mb(key: str) -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


def _peak_child(args, queue):
    kind, impl, k, batch, n, device = args
    fn = make_case(kind, impl, k, batch, n, device)
    fn()  # warm-up: lazily created buffers and caches are not what we measure
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        queue.put((torch.cuda.max_memory_allocated() - base) / 2**20)
    else:
        base = _proc_status_mb("VmRSS")
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")  # resets VmHWM, the peak resident set, to the current resident set
        fn()
        queue.put(_proc_status_mb("VmHWM") - base)


def peak_memory_mb(kind, impl, k, batch, n, device) -> float:
    # A fixed mmap threshold makes glibc return every large freed block to the OS, so the resident set follows
    # the live tensors instead of the allocator's high-water mark.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_peak_child, args=((kind, impl, k, batch, n, device), queue))
    proc.start()
    value = queue.get()
    proc.join()
    return value


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    shapes = {197: 8, 1024: 1} if args.device == "cpu" else {197: 64, 1024: 8}
    report = {"device": args.device, "dim": DIM, "heads": HEADS, "threads": torch.get_num_threads(), "shapes": {}}
    for n, batch in shapes.items():
        entry = {"batch": batch}
        for kind in ("core", "block"):
            cases = {
                "fast_k0": make_case(kind, "fast", 0, batch, n, args.device),
                "fast_k12": make_case(kind, "fast", HEADS, batch, n, args.device),
                "materialised_k12": make_case(kind, "materialised", HEADS, batch, n, args.device),
            }
            t = interleaved_medians(cases, args.device, args.repeats)
            peak_fast = peak_memory_mb(kind, "fast", HEADS, batch, n, args.device)
            peak_mat = peak_memory_mb(kind, "materialised", HEADS, batch, n, args.device)
            entry[kind] = {
                "median_s": {name: round(v, 5) for name, v in t.items()},
                "k_ratio": round(t["fast_k0"] / t["fast_k12"], 4),
                "speedup_vs_materialised": round(t["materialised_k12"] / t["fast_k12"], 3),
                "peak_memory_mb": {"fast": round(peak_fast, 1), "materialised": round(peak_mat, 1)},
                "memory_ratio_materialised_over_fast": round(peak_mat / max(peak_fast, 1e-6), 2),
            }
        report["shapes"][f"N={n}"] = entry
    core_1024 = report["shapes"]["N=1024"]["core"]
    report["targets"] = {
        "k_ratio_min_over_shapes": min(e[kind]["k_ratio"] for e in report["shapes"].values()
                                       for kind in ("core", "block")),
        "k_ratio_target": 0.98,
        "core_speedup_at_1024": core_1024["speedup_vs_materialised"],
        "core_speedup_target": 3.0,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
