"""Which part of a training step pays a one-time cost for each new padded sequence length? (The GRPO recipe's
first timed variant showed 1-2.7 s forward+backward spikes at new lengths; this isolates the decoder.)

Qwen2.5-0.5B shape, random init, bf16, gradient checkpointing, batch 16 with left padding on half the rows (as GRPO
prompts have): forward + backward of the decoder at new and repeated lengths, under SDPA's default backend choice
and under each backend forced. Prints one line per call; ~1 minute on an H100:

    python3 benchmarks/sdpa_shape_warmup.py
"""

import time

import shapes  # noqa: E402
import torch
import transformers
from torch.nn.attention import SDPBackend, sdpa_kernel


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(**shapes.config("qwen2.5-0.5b"), max_position_embeddings=32768)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).cuda().train()
    model.gradient_checkpointing_enable()
    return model


def step(model: torch.nn.Module, length: int, pad: bool = True) -> tuple[float, float]:
    """Forward and backward milliseconds of the decoder on a [16, length] batch."""
    ids = torch.randint(3, 1000, (16, length), device="cuda")
    mask = torch.ones_like(ids)
    if pad:
        mask[:8, :5] = 0  # left padding on half the rows
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    out.float().pow(2).mean().backward()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3


def main() -> None:
    model = build()
    print("attention implementation:", model.config._attn_implementation, flush=True)
    for length in (270, 270):  # process-wide first-call costs, not per length
        step(model, length)
    cases = [
        ("default", None, (281, 281, 283, 283, 260)),
        ("flash only (no mask)", SDPBackend.FLASH_ATTENTION, (285, 285, 287)),
        ("efficient only", SDPBackend.EFFICIENT_ATTENTION, (289, 289, 291)),
        ("cudnn only", SDPBackend.CUDNN_ATTENTION, (293, 293, 295)),
        ("math only", SDPBackend.MATH, (297, 297)),
    ]
    for label, backend, lengths in cases:
        for length in lengths:
            if backend is None:
                fwd, bwd = step(model, length)
            else:
                with sdpa_kernel(backend):
                    fwd, bwd = step(model, length, pad=backend != SDPBackend.FLASH_ATTENTION)
            print(f"{label:22s} L={length}: fwd {fwd:7.1f} ms  bwd {bwd:7.1f} ms", flush=True)


if __name__ == "__main__":
    main()
