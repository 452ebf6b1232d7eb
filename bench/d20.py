"""The paper's language model, nanochat's d20, one training step at its context of 2048 tokens: tokens/s and peak
memory of forward + backward in bf16, without Laplacian heads, with the paper's ramp (from layer 4, one more per
layer, at most 5) and with STLT mixers in every layer. Measured side by side in one run, repeats interleaved,
medians reported. Prints one JSON object with each variant's figures and their ratios to the baseline's
(`ramp_vs_baseline` throughput: Laplacian heads cost no parameters and should cost next to no time). Peak memory
(CUDA) is what a step adds over the resident weights: its activations and gradients.

    python bench/d20.py --device cuda                       # the GPU check (bench/gpu_check.sh)
    python bench/d20.py --preset gpt_tiny --seq-len 128 --start-layer 1 --max-count 2  # on a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from models import build_model, count_parameters


def variants(start_layer: int, max_count: int) -> dict[str, dict]:
    return {"baseline": {"k": 0},
            "ramp": {"laplacian_schedule": "ramp", "start_layer": start_layer, "increment": 1, "max_count": max_count},
            "stlt": {"mixer": "stlt"}}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model, tokens: torch.Tensor, device: torch.device) -> None:
    with torch.autocast(device.type, dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])
    F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()).backward()
    model.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--preset", default="gpt_d20")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--start-layer", type=int, default=4, help="the ramp's first layer (the paper's: 4)")
    parser.add_argument("--max-count", type=int, default=5, help="the ramp's cap (the paper's: 5)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)

    models = {name: build_model({"preset": args.preset, "context_length": args.seq_len, **overrides}, device)
              for name, overrides in variants(args.start_layer, args.max_count).items()}
    vocab = models["baseline"].config.vocab_size
    tokens = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), device=device)
    params = {name: count_parameters(model) for name, model in models.items()}

    peak_mb = {}
    for name, model in models.items():  # warm-up (Triton compiles the STLT kernels here) and peak memory
        _step(model, tokens, device)
        _sync(device)
        if device.type == "cuda":
            # What the step adds over what is resident (every variant's weights, kept for the interleaved timing):
            # its activations and gradients, as bench/attention.py measures its cases.
            torch.cuda.reset_peak_memory_stats(device)
            resident = torch.cuda.memory_allocated(device)
            _step(model, tokens, device)
            _sync(device)
            peak_mb[name] = (torch.cuda.max_memory_allocated(device) - resident) / 2**20

    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(args.repeats):
        for name, model in models.items():
            _sync(device)
            start = time.perf_counter()
            _step(model, tokens, device)
            _sync(device)
            times[name].append(time.perf_counter() - start)

    step_tokens = args.batch_size * args.seq_len
    tokens_per_s = {name: step_tokens / statistics.median(t) for name, t in times.items()}
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "preset": args.preset, "seq_len": args.seq_len, "batch_size": args.batch_size, "repeats": args.repeats,
        "parameters": params,
        "tokens_per_s": {name: round(value, 1) for name, value in tokens_per_s.items()},
        "throughput_vs_baseline": {name: round(value / tokens_per_s["baseline"], 3)
                                   for name, value in tokens_per_s.items() if name != "baseline"},
    }
    if peak_mb:
        report["peak_memory_mb"] = {name: round(value, 1) for name, value in peak_mb.items()}
        report["peak_memory_vs_baseline"] = {name: round(value / peak_mb["baseline"], 3)
                                             for name, value in peak_mb.items() if name != "baseline"}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
