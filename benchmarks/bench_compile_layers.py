"""Compiled decoder layers vs stock and vs ``patch_trainer`` without them, on one GPU: the probe's variants
(``probe_compile_layers.py``: Llama-3.2-1B shape, LoRA r16, checkpointing, fixed 4 x 2048 and variable lengths, each
variant in its own process). ``python benchmarks/bench_compile_layers.py --out DIR`` writes the JSON rows there."""

from __future__ import annotations

from probe_compile_layers import main


if __name__ == "__main__":
    main()
