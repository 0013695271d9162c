"""Shared pieces of the example scripts: named model shapes (random init), the corpus, per-rank step statistics."""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from leantrain.cli import tiny


sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the shared shapes table
import shapes  # noqa: E402


# Shapes of public models (benchmarks/shapes.py, the one table), built from config with random weights (nothing
# downloaded): example name -> (tiny family, shapes.py name). Embeddings untied, as tiny_config makes them.
SHAPES: dict[str, tuple[str, str]] = {
    "smollm2-135m": ("llama", "smollm2-135m"),
    "qwen2.5-0.5b": ("qwen2", "qwen2.5-0.5b"),
    "llama-1b": ("llama", "llama-3.2-1b"),
    # MoE (every layer sparse, 128 experts top-8); --layers cuts its depth for short runs
    "qwen3-30b-a3b": ("qwen3_moe", "qwen3-30b-a3b"),
}


def build_model(shape: str, vocab_size: int, layers: int | None = None) -> transformers.PreTrainedModel:
    """``tiny-<family>`` (leantrain.cli.tiny) or a named shape; bf16 on CUDA, fp32 on CPU. The vocab of a named shape
    is kept (it drives the LM-head cost); token ids from the small tokenizer are a subset of it. ``layers``
    overrides the decoder layer count. On CUDA the weights are initialised on this rank's GPU (LOCAL_RANK): a
    random init of half a billion parameters takes seconds on the CPU, milliseconds there."""
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if shape.startswith("tiny-"):
        extra = {"layers": layers} if layers else {}
        return tiny.tiny_model(shape.removeprefix("tiny-"), dtype=dtype, vocab_size=vocab_size, **extra).train()
    family, name = SHAPES[shape]
    spec = shapes.config(name, **({"num_hidden_layers": layers} if layers else {}))
    spec.pop("tie_word_embeddings")
    spec.setdefault("head_dim", spec["hidden_size"] // spec["num_attention_heads"])
    config = tiny.tiny_config(
        family,
        vocab_size=spec.pop("vocab_size"),
        hidden=spec.pop("hidden_size"),
        layers=spec.pop("num_hidden_layers"),
        **spec,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    device = torch.device("cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)  # before any CUDA work: no context of this rank on another rank's GPU
    with device:
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).train()


def lora_config(r: int = 16, attention_only: bool = False):
    """LoRA on the attention projections (and the MLP's, unless ``attention_only``: a MoE's experts stay frozen);
    the embeddings and LM head stay frozen."""
    from peft import LoraConfig

    targets = ["q_proj", "k_proj", "v_proj", "o_proj"]
    if not attention_only:
        targets += ["gate_proj", "up_proj", "down_proj"]
    return LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=targets)


def run_args(out: Path, steps: int) -> dict[str, Any]:
    """Trainer arguments every example shares: bf16 on CUDA, CPU otherwise, log each step, save nothing."""
    cuda = torch.cuda.is_available()
    return dict(
        output_dir=str(out),
        max_steps=steps,
        bf16=cuda,
        use_cpu=not cuda,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )


def corpus_dataset(n: int, column: str = "text"):
    from datasets import Dataset

    texts = tiny.corpus_texts()
    texts = (texts * (n // len(texts) + 1))[:n]
    if column == "prompt":
        texts = [" ".join(t.split()[:16]) for t in texts]
    return Dataset.from_dict({column: texts})


def patch_train_record(trainer, out: Path, name: str) -> dict[str, Any]:
    """Patch with leantrain (rank 0 prints the report), train, and write this rank's step statistics."""
    import leantrain

    report = leantrain.patch_trainer(trainer)
    if trainer.is_world_process_zero():
        print(report, flush=True)
    stats = StepStats()
    trainer.add_callback(stats.callback())
    trainer.train()
    written = stats.write(out, name, trainer, leantrain.current_report(trainer))
    # Leave together, then tear the process group down before the interpreter does: a rank that exits while its peer's
    # gloo connections are open, or leaves the group to the interpreter's teardown, can abort that peer ("terminate
    # called without an active exception") after a finished run.
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    return written


def versions() -> dict[str, str]:
    """The versions this run trained with (the results name them; a table made elsewhere must not use its own)."""
    from importlib import metadata

    out = {}
    for name in ("torch", "transformers", "trl", "peft", "accelerate", "deepspeed", "bitsandbytes", "liger-kernel"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return out


class StepStats:
    """Wall time per optimizer step (after 2 warm-up steps) and peak CUDA memory of this rank."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def callback(self):
        stats = self

        class Callback(transformers.TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                stats._t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                stats.times.append((time.perf_counter() - stats._t0) * 1e3)

        return Callback()

    def write(self, out: Path, name: str, trainer, report) -> dict[str, Any]:
        times = self.times[2:] or self.times
        row = {
            "example": name,
            "rank": trainer.args.process_index,
            "world_size": trainer.args.world_size,
            "distributed": str(trainer.accelerator.distributed_type),
            "zero_stage": getattr(trainer.accelerator.state.deepspeed_plugin, "zero_stage", None),
            "step_ms_p50": statistics.median(times) if times else None,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None,
            "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
            "dtype": "bf16" if trainer.args.bf16 else "fp32",  # the compute dtype the loss bound is derived for
            "layers": getattr(trainer.model.config, "num_hidden_layers", None),
            "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
            "kl": [e["kl"] for e in trainer.state.log_history if "kl" in e],  # GRPO with beta > 0
            # TRL logs the running count of input tokens over all ranks as `num_tokens`
            "num_tokens": max((e.get("num_tokens", 0) for e in trainer.state.log_history), default=0),
            "steps": trainer.state.global_step,
            "report": report.to_dict() if report else None,
            "versions": versions(),
        }
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}_rank{row['rank']}.json").write_text(json.dumps(row, indent=1))
        return row
