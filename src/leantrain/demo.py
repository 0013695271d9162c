"""`python -m leantrain demo`: train a tiny model twice, stock and patched, and compare.

Everything is local: the model is built from a config (random init), the tokenizer is trained on Python's own
documentation, and the training text is the same documentation. Prints the patch report and a side-by-side table,
and writes a loss-curve PNG and a JSON summary into ``--out``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import tiny
from .patching import patch_trainer, unpatch_trainer


DEMO_MODELS = {"llama": "llama", "gpt2": "gpt2", "gpt-oss": "gpt_oss"}


@dataclass
class RunResult:
    name: str
    losses: list[tuple[int, float]] = field(default_factory=list)
    rewards: list[tuple[int, float]] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    peak_mib: float = float("nan")
    eval_loss: float = float("nan")  # held-out texts, every token (evaluation is never masked)
    report: str = ""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else float("nan")

    @property
    def final_loss(self) -> float:
        tail = [loss for _, loss in self.losses[-5:]]
        return sum(tail) / len(tail) if tail else float("nan")


class _PeakRSS:
    """Samples this process's resident memory in a thread: the CPU stand-in for CUDA's peak-memory counter."""

    def __init__(self, interval: float = 0.02) -> None:
        self.interval, self.peak, self._stop = interval, 0, threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def _rss(self) -> int:
        try:
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * self._page
        except OSError:
            return 0

    def __enter__(self) -> _PeakRSS:
        self.peak = self._rss()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self.peak = max(self.peak, self._rss())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


def _dataset(tokenizer, n: int, held_out: bool = False):
    from datasets import Dataset

    texts = tiny.corpus_texts()
    texts = texts[-64:] if held_out else texts[:-64][:n]  # the last 64 paragraphs are never trained on
    return Dataset.from_dict({"text": texts})


def _prompts(n: int):
    from datasets import Dataset

    texts = tiny.corpus_texts()[:n]
    return Dataset.from_dict({"prompt": [" ".join(t.split()[:12]) for t in texts]})


def letter_reward(completions: list[str], **_: Any) -> list[float]:
    """Toy reward for the GRPO demo: the share of letters and spaces in the completion."""
    return [sum(c.isalpha() or c == " " for c in text) / max(1, len(text)) for text in completions]


def _make_trainer(args: argparse.Namespace, out: Path, run_name: str):
    tokenizer = tiny.train_tokenizer(args.vocab)
    family = DEMO_MODELS[args.model]
    model = tiny.tiny_model(family, seed=args.seed, vocab_size=len(tokenizer), hidden=args.hidden, layers=4).train()
    if family == "gpt_oss" and importlib.util.find_spec("bitsandbytes"):
        # Frozen 4-bit experts in both runs, so the patched run can show the grouped 4-bit path (moe4bit).
        from .moe4bit import quantize_experts_4bit

        quantize_experts_4bit(model)
    common = dict(
        output_dir=str(out / run_name),
        max_steps=args.steps,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        use_cpu=not torch.cuda.is_available(),
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if args.trainer == "sft":
        from trl import SFTConfig, SFTTrainer

        config = SFTConfig(**common, per_device_train_batch_size=8, max_length=args.seq, lr_scheduler_type="constant")
        return SFTTrainer(
            model=model,
            args=config,
            train_dataset=_dataset(tokenizer, 8 * args.steps),
            eval_dataset=_dataset(tokenizer, 0, held_out=True),
            processing_class=tokenizer,
        )
    from trl import GRPOConfig, GRPOTrainer

    # With beta > 0 TRL builds the reference model from a path: save the tiny model locally (no hub involved).
    local = out / f"tiny-{args.model}"
    model.save_pretrained(local)
    tokenizer.save_pretrained(local)
    config = GRPOConfig(
        **common, per_device_train_batch_size=4, num_generations=4, max_completion_length=24, beta=0.04
    )
    return GRPOTrainer(
        model=str(local),
        reward_funcs=letter_reward,
        args=config,
        train_dataset=_prompts(4 * args.steps),
        processing_class=tokenizer,
    )


def _run(args: argparse.Namespace, out: Path, patched: bool) -> RunResult:
    name = "leantrain" if patched else "stock"
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer = _make_trainer(args, out, name)
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(_Progress(f"{name:>9}"))
    result = RunResult(name)
    if patched:
        # The demo asks for the trainer's optimization explicitly: CGGR is opt-in (it changes which tokens train),
        # and the demo is there to show it at work (on CPU TRL's fused head scores every row: no LM-head saving).
        options: dict[str, Any] = {"grpo_logps": True}
        if args.trainer == "sft":
            options = dict(cggr=True, cggr_warmup_steps=max(1, args.steps // 4), cggr_min_tokens_ratio=0.5)
        report = patch_trainer(trainer, **options)
        result.report = str(report)
        print(report, flush=True)
    print(f"\n== {name} run: {args.steps} steps of {args.trainer} on a tiny {args.model} ==", flush=True)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    with _PeakRSS() as rss:
        start = time.perf_counter()
        trainer.train()
        result.seconds = time.perf_counter() - start
    result.peak_mib = (torch.cuda.max_memory_allocated() if torch.cuda.is_available() else rss.peak) / 2**20
    for entry in trainer.state.log_history:
        if "loss" in entry:
            result.losses.append((entry["step"], float(entry["loss"])))
        if "reward" in entry:
            result.rewards.append((entry["step"], float(entry["reward"])))
    result.tokens = int(trainer.state.num_input_tokens_seen or 0) or _count_tokens(trainer)
    if trainer.eval_dataset is not None:
        result.eval_loss = float(trainer.evaluate()["eval_loss"])
    if patched:
        unpatch_trainer(trainer)
    return result


def _count_tokens(trainer) -> int:
    # TRL logs the running count of input tokens as `num_tokens`.
    return int(max((e.get("num_tokens", 0) for e in trainer.state.log_history), default=0))


class _Progress:
    """A one-line progress bar with the latest loss, in place of the Trainer's per-step log dump."""

    def __new__(cls, name: str):
        from tqdm.auto import tqdm
        from transformers import TrainerCallback

        class Progress(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                self.bar = tqdm(total=state.max_steps, desc=name, unit="step", dynamic_ncols=True)

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    extra = {"reward": f"{logs['reward']:.3f}"} if "reward" in logs else {}
                    self.bar.set_postfix(loss=f"{logs['loss']:.3f}", **extra)

            def on_step_end(self, args, state, control, **kwargs):
                self.bar.update(state.global_step - self.bar.n)

            def on_train_end(self, args, state, control, **kwargs):
                self.bar.close()

        return Progress()


def _table(stock: RunResult, lean: RunResult, mem_label: str) -> str:
    rows = [
        ("train loss (mean of last 5 logs)", f"{stock.final_loss:.4f}", f"{lean.final_loss:.4f}"),
        ("eval loss, held-out, all tokens", f"{stock.eval_loss:.4f}", f"{lean.eval_loss:.4f}"),
        ("train time (s)", f"{stock.seconds:.1f}", f"{lean.seconds:.1f}"),
        ("tokens/s", f"{stock.tokens_per_s:,.0f}", f"{lean.tokens_per_s:,.0f}"),
        (mem_label, f"{stock.peak_mib:,.0f}", f"{lean.peak_mib:,.0f}"),
    ]
    if stock.rewards:
        mean = lambda r: sum(v for _, v in r[-5:]) / max(1, len(r[-5:]))  # noqa: E731
        rows.append(("reward (mean of last 5 logs)", f"{mean(stock.rewards):.3f}", f"{mean(lean.rewards):.3f}"))
    widths = [max(len(r[i]) for r in rows + [("", "stock", "leantrain")]) for i in range(3)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(("", "stock", "leantrain"), widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def _plot(stock: RunResult, lean: RunResult, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("losses", "training loss")] + ([("rewards", "mean reward")] if stock.rewards else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4), squeeze=False)
    for ax, (attr, label) in zip(axes[0], panels):
        for run in (stock, lean):
            points = getattr(run, attr)
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, label=run.name, linestyle="-" if run.name == "stock" else "--")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="leantrain demo")
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run (default 30)")
    parser.add_argument("--model", choices=sorted(DEMO_MODELS), default="llama")
    parser.add_argument("--trainer", choices=("sft", "grpo"), default="sft")
    parser.add_argument("--out", type=Path, default=Path("leantrain-demo"), help="where the PNG and JSON go")
    parser.add_argument("--seq", type=int, default=128, help="max sequence length (sft)")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    stock = _run(args, out, patched=False)
    lean = _run(args, out, patched=True)
    mem_label = "peak CUDA memory (MiB)" if torch.cuda.is_available() else "peak process RSS (MiB)"
    print("\n" + lean.report + "\n")
    print(_table(stock, lean, mem_label))
    png = out / "loss_curve.png"
    _plot(stock, lean, png, f"leantrain demo: tiny {args.model}, {args.trainer}, {args.steps} steps")
    summary = {"args": {k: str(v) for k, v in vars(args).items()}, "stock": asdict(stock), "leantrain": asdict(lean)}
    (out / "demo.json").write_text(json.dumps(summary, indent=1))
    print(f"\nloss curve: {png}\nsummary:    {out / 'demo.json'}")
    return summary
