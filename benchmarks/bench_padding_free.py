"""Padding-free batches (``padding_free=True``) against the trainer's padded batches on varying-length SFT data.

One trainer in one process, the two alternating in segments (``bench_step_ab.py``'s machinery: each segment a
``trainer.train()`` from the first batch, so both variants train on the same rows), each segment's first step
dropped. The case is one of ``bench_vs_unsloth.py``'s: by default ``llama-3.2-1b-varlen`` (Llama-3.2-1B LoRA r16 on all
7 projections, bf16, activation checkpointing, 4 sequences a step of lognormal lengths, median 500, clipped to
[64, 2048], SDPA attention). Both variants train the same rows, so the step-time ratio is the ratio of real tokens a
second. Recorded per variant: the median step (p20/p80, each segment's median) and the peak allocated GPU memory
over its segments (weights included).

    python benchmarks/bench_padding_free.py                               # CUDA, ~2 min
    python benchmarks/bench_padding_free.py --also compile_layers=True     # options for both variants
    python benchmarks/bench_padding_free.py --smoke                       # tiny shapes on the CPU, seconds
On the GPU machine, with the CUDA parity tests first (carry .whl and .bench_commit):
    bash benchmarks/gpu_run.sh parity padding_free
Beside Unsloth on the varying-length row (the environment turns padding_free on in the leantrain processes):
    LEANTRAIN_PADDING_FREE=1 bash benchmarks/gpu_vs_unsloth.sh --cases llama-3.2-1b-varlen \
        --providers leantrain_offload,unsloth

Rows go to ``padding_free.json`` / ``.md`` in ``$BENCH_RESULTS`` or ``benchmarks/results``.
"""

from __future__ import annotations

import argparse

import bench_step_ab


NAME = "padding_free"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    parser.add_argument("--case", default="", help="a varying-length bench_vs_unsloth.py case")
    parser.add_argument("--also", action="append", default=[], help="name=value for patch_trainer, both variants")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", default="")
    args = parser.parse_args(argv)
    case = args.case or ("tiny-llama-varlen" if args.smoke else "llama-3.2-1b-varlen")
    also = [item for pair in args.also for item in ("--opt", pair)]
    forwarded = ["--case", case, "--pairs", str(args.pairs), "--steps", str(args.steps), "--name", NAME]
    forwarded += ["--smoke"] * args.smoke + (["--out", args.out] if args.out else [])
    base = [item.replace("--opt", "--base-opt") for item in also]
    bench_step_ab.main([*forwarded, "--base-opt", "padding_free=False", *base, "--opt", "padding_free=True", *also])


if __name__ == "__main__":
    main()
