"""CGGR benchmark: TRL SFTTrainer training steps (forward + backward through ``trainer.training_step``, with the
trainer's own ``get_batch_samples`` counting) on random-init models built from config, seq 2048, batch 8, bf16.

Variants per shape: stock; leantrain CGGR (entropy) at ratio 0.25 and 0.5 (router after layer 2, and at 0.25 also on
the final hidden state, ``cggr-entropy-top``); the random-selection control through the
same machinery (``cggr_scoring="random"``: same kept count, no scoring); and the no-scoring bound (stock trainer on
labels masked at random beforehand). Reports median step time (p20/p80), tokens/s, peak memory and CGGR's scoring
time. Then a short quality run: each variant trains the same small model from scratch on the
``leantrain.cli.tiny`` corpus for a fixed number of steps; eval loss over all held-out tokens.

    python benchmarks/bench_cggr.py            # CUDA, full size (< 4 min on an H100)
    python benchmarks/bench_cggr.py --smoke    # CPU, tiny shapes (< 60 s)

Writes ``bench_cggr.json`` / ``.md`` / ``.png`` into ``$BENCH_RESULTS`` or ``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import time
from pathlib import Path

import shapes  # noqa: E402
import torch
from _harness import RESULTS, Row, bar_plot, markdown_table, peak_memory, time_fn, write_results  # noqa: E402

import leantrain  # noqa: E402
from leantrain.cggr.ops import select_topk, targets_of  # noqa: E402
from testkit.optimizations import others_off  # noqa: E402


OFF = others_off("cggr")
SHAPES = {  # (config class, fields): the released models' sizes (benchmarks/shapes.py), tied embeddings
    name: (shapes.shape(name).cls, shapes.config(name)) for name in ("smollm2-135m", "qwen2.5-0.5b", "qwen2.5-1.5b")
}
SMOKE_SHAPES = {
    "tiny-llama": (
        "LlamaConfig",
        dict(
            vocab_size=2048,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
        ),
    ),
}


def build_model(kind: str, fields: dict, dtype: torch.dtype, device: str) -> torch.nn.Module:
    import transformers

    config = getattr(transformers, kind)(**{"tie_word_embeddings": True, **fields}, max_position_embeddings=4096)
    attn = "sdpa" if device == "cuda" else "eager"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn)
    return model


def sft_trainer(model, out_dir: Path, data, device: str, **args):
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from leantrain.cli.tiny import train_tokenizer

    config = dict(
        output_dir=str(out_dir),
        report_to=[],
        save_strategy="no",
        bf16=device == "cuda",
        use_cpu=device == "cpu",
        gradient_checkpointing=True,  # SFTConfig's default
        per_device_train_batch_size=8,
        max_length=None,
        dataset_num_proc=None,
    )
    config.update(args)
    return SFTTrainer(
        model=model,
        args=SFTConfig(**config),
        train_dataset=Dataset.from_list(data),
        processing_class=train_tokenizer(),
    )


def random_batches(vocab: int, batch: int, seq: int, device: str, count: int = 2) -> list[dict]:
    """Full-length rows with a short unlabelled prompt, like completion-only SFT on packed data."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(count):
        ids = torch.randint(3, vocab, (batch, seq), generator=g)
        labels = ids.clone()
        labels[:, : seq // 16] = -100
        out.append(
            {
                "input_ids": ids.to(device),
                "attention_mask": torch.ones_like(ids).to(device),
                "labels": labels.to(device),
            }
        )
    return out


def masked_at_random(batch: dict, ratio: float, seed: int) -> dict:
    """The no-scoring bound: labels kept at random, the same per-row count CGGR keeps."""
    targets = targets_of(batch)
    g = torch.Generator(device=targets.device).manual_seed(seed)
    keep = select_topk(torch.rand(targets.shape, generator=g, device=targets.device), targets != -100, None, ratio)
    labels = batch["labels"].clone()
    labels[:, 1:][~keep] = -100
    return {**batch, "labels": labels}


def step_fn(trainer, batches):
    def run(i: int) -> None:
        samples, count = trainer.get_batch_samples(iter([batches[i % len(batches)]]), 1, trainer.args.device)
        trainer.training_step(trainer.model, samples[0], count)
        trainer.model.zero_grad(set_to_none=True)

    return run


def speed(args, rows: list[Row], table: list[list]) -> None:
    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.bfloat16)
    shapes = SMOKE_SHAPES if args.smoke else {k: SHAPES[k] for k in args.shapes.split(",")}
    seq, batch = (64, 2) if args.smoke else (2048, 8)
    warmup, reps = (1, 3) if args.smoke else (3, 10)
    ratios = (0.25,) if args.smoke else (0.25, 0.5)
    for name, (kind, fields) in shapes.items():
        if time.perf_counter() - START > args.budget_s:
            print(f"skipping {name}: over the {args.budget_s} s budget")
            continue
        model = build_model(kind, fields, dtype, device)
        data = [{"input_ids": list(range(3, 19))}] * 2
        trainer = sft_trainer(model, Path(args.out) / "tmp", data, device, gradient_checkpointing=not args.smoke)
        batches = random_batches(fields["vocab_size"], batch, seq, device)
        tokens = batch * seq
        common = dict(shape=name, seq=seq, batch=batch, dtype=str(dtype), gradient_checkpointing=not args.smoke)
        variants = [("stock", None, None, 2)]
        for ratio in ratios:
            variants += [
                ("cggr-entropy", ratio, "entropy", 2),
                ("random-select", ratio, "random", 2),
                ("bound", ratio, None, 2),
            ]
        # Router depth: the hook rides the one forward, so scoring the final hidden state should cost the same
        variants.insert(2, ("cggr-entropy-top", ratios[0], "entropy", -1))
        base_ms = None
        for provider, ratio, scoring, layers in variants:
            run_batches = batches
            runtime = None
            if scoring is not None:
                leantrain.patch_trainer(
                    trainer,
                    cggr=True,
                    cggr_min_tokens_ratio=ratio,
                    cggr_scoring=scoring,
                    cggr_router_layers=layers,
                    cggr_warmup_steps=0,
                    **OFF,
                )
                runtime = trainer._leantrain_cggr
            elif ratio is not None:
                run_batches = [masked_at_random(b, ratio, seed=i) for i, b in enumerate(batches)]
            fn = step_fn(trainer, run_batches)
            t = time_fn(fn, warmup=warmup, reps=reps)
            mem = peak_memory(lambda fn=fn: fn(0))
            score_ms = runtime.read_stats()["cggr/score_ms"] if runtime is not None else 0.0
            if scoring is not None:
                leantrain.unpatch_trainer(trainer)
            label = provider if ratio is None else f"{provider}@{ratio}"
            base_ms = t.p50 if provider == "stock" else base_ms
            cfg = {**common, "ratio": ratio, "scoring": scoring, "router_layers": layers}
            rows.append(Row.timing("cggr", provider, "train_step", "shape", f"{name} r={ratio}", t, **cfg))
            rows.append(
                Row("cggr", provider, "train_step", "memory", "GiB", "shape", f"{name} r={ratio}", mem, config=cfg)
            )
            rows.append(
                Row(
                    "cggr",
                    provider,
                    "train_step",
                    "throughput",
                    "tokens/s",
                    "shape",
                    f"{name} r={ratio}",
                    tokens / t.p50 * 1e3,
                    config=cfg,
                )
            )
            table.append([name, label, t.p50, t.p20, t.p80, tokens / t.p50 * 1e3, base_ms / t.p50, mem, score_ms])
            print(table[-1], flush=True)
        del trainer, model
        if device == "cuda":
            torch.cuda.empty_cache()


def corpus_blocks(tokenizer, seq: int) -> torch.Tensor:
    from leantrain.cli.tiny import corpus_texts

    ids: list[int] = []
    for text in corpus_texts():
        ids += tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    n = len(ids) // seq
    return torch.tensor(ids[: n * seq]).view(n, seq)


@torch.no_grad()
def eval_loss(model, blocks: torch.Tensor, device: str, batch: int) -> float:
    """Mean next-token loss over every held-out token."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, blocks.shape[0], batch):
        ids = blocks[start : start + batch].to(device)
        logits = model(input_ids=ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum")
        total += loss.item()
        count += ids[:, 1:].numel()
    return total / count


def quality(args, rows: list[Row], table: list[list]) -> None:
    from leantrain.cli.tiny import train_tokenizer

    device, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.float32)
    seq, batch, steps = (32, 2, 4) if args.smoke else (256, 32, 300)
    tokenizer = train_tokenizer(2048 if args.smoke else 4096)
    blocks = corpus_blocks(tokenizer, seq)
    g = torch.Generator().manual_seed(0)
    blocks = blocks[torch.randperm(blocks.shape[0], generator=g)]
    n_eval = max(8, blocks.shape[0] // 10)
    held_out, train = blocks[:n_eval], blocks[n_eval:]
    if args.smoke:
        held_out, train = held_out[:8], train[: steps * batch]
    fields = dict(
        vocab_size=len(tokenizer),
        hidden_size=64 if args.smoke else 384,
        num_hidden_layers=4,
        num_attention_heads=2 if args.smoke else 6,
        num_key_value_heads=1 if args.smoke else 2,
        intermediate_size=128 if args.smoke else 1024,
    )
    base = build_model("LlamaConfig", fields, dtype, device)
    data = [{"input_ids": row.tolist()} for row in train]
    ratios = (0.25,) if args.smoke else (0.25, 0.5)
    variants = [("stock", None, None)] + [(f"{s}@{r}", r, s) for r in ratios for s in ("entropy", "random")]
    for label, ratio, scoring in variants:
        model = copy.deepcopy(base)
        trainer = sft_trainer(
            model,
            Path(args.out) / "tmp_q",
            data,
            device,
            per_device_train_batch_size=batch,
            max_steps=steps,
            learning_rate=2e-3,
            lr_scheduler_type="cosine",
            warmup_steps=steps // 10,
            gradient_checkpointing=False,
            logging_steps=max(1, steps // 10),
            seed=0,
            bf16=device == "cuda",
        )
        if scoring is not None:
            leantrain.patch_trainer(
                trainer,
                cggr=True,
                cggr_min_tokens_ratio=ratio,
                cggr_scoring=scoring,
                cggr_warmup_steps=steps // 10,
                **OFF,
            )
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
        loss = eval_loss(model, held_out, device, batch)
        cfg = {"ratio": ratio, "scoring": scoring, "steps": steps, "seq": seq, "batch": batch, "fields": fields}
        rows.append(Row("cggr", label, "quality", "quality", "eval_loss", "variant", label, loss, config=cfg))
        table.append([label, steps, loss, math.exp(loss), wall])
        print(table[-1], flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (< 60 s)")
    parser.add_argument("--shapes", default="smollm2-135m,qwen2.5-0.5b,qwen2.5-1.5b")
    parser.add_argument("--budget-s", type=float, default=150.0, help="skip further shapes after this many seconds")
    parser.add_argument("--skip-quality", action="store_true")
    parser.add_argument("--out", default=os.environ.get("BENCH_RESULTS", str(RESULTS)))
    args = parser.parse_args()
    if args.smoke:
        torch.set_num_threads(min(2, os.cpu_count() or 1))
    elif not torch.cuda.is_available():
        parser.error("the full benchmark needs CUDA; use --smoke on CPU")
    rows: list[Row] = []
    speed_table: list[list] = []
    quality_table: list[list] = []
    speed(args, rows, speed_table)
    if not args.skip_quality:
        quality(args, rows, quality_table)
    text = markdown_table(
        ["shape", "variant", "step ms p50", "p20", "p80", "tokens/s", "speedup vs stock", "peak GiB", "score ms"],
        speed_table,
    )
    if quality_table:
        text += "\n\nQuality (eval loss over all held-out tokens, same steps):\n\n"
        text += markdown_table(["variant", "steps", "eval loss", "ppl", "train wall s"], quality_table)
    out = write_results("bench_cggr", rows, text, Path(args.out))
    groups = sorted({r[0] for r in speed_table}, key=[r[0] for r in speed_table].index)
    labels = sorted({r[1] for r in speed_table}, key=[r[1] for r in speed_table].index)
    series = {
        lab: [next((r[2] for r in speed_table if r[0] == g and r[1] == lab), 0.0) for g in groups] for lab in labels
    }
    bar_plot(out / "bench_cggr.png", "CGGR: SFT training step (lower is better)", groups, series, "ms per step")
    print(text)
    print(f"wrote {out}/bench_cggr.{{json,md,png}} in {time.perf_counter() - START:.0f} s")


START = time.perf_counter()

if __name__ == "__main__":
    main()
