"""`python -m leantrain demo`: train a tiny model twice, stock and patched with leantrain's defaults, and compare.

The default shows what ``patch_trainer(trainer)`` does with no options: a tiny gpt-oss MoE whose 32 experts are
frozen nf4 ``Linear4bit`` lists (the layout of community pre-quantized gpt-oss checkpoints) trains with the grouped
4-bit experts (moe4bit) in place of the per-expert loop; the loss curves match stock within a printed bound and the
per-step time drops. CGGR changes which tokens train: it runs only with ``--cggr``.

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
from .entry import current_report, patch_trainer, unpatch_trainer


DEMO_MODELS = {"llama": "llama", "gpt2": "gpt2", "gpt-oss": "gpt_oss"}
NO_VALUE = "—"  # a table cell with nothing to show (a GRPO run has no eval loss): never "nan"
# Stock and patched losses agree within this share of the loss. leantrain's grouped path equals the stock per-expert
# loop up to the fp32 summation order (a few ulps, eps 1.2e-7, per step), and Adam carries that through the later
# steps. On CPU the stock bitsandbytes 4-bit layers add more: their first training forward in the Trainer came out up
# to ~3e-5 of the loss off the same layers' later forwards on the same inputs (measured, 32 experts; leantrain's
# path equals the later ones), and 20 steps carried that to <= 3.3e-4 of the loss. 1e-3 covers it with room for
# other x86 kernels, and stays well below what a wrong expert output does (the loss moves by > 1e-2 per step here).
LOSS_RTOL = 1e-3


@dataclass
class RunResult:
    name: str
    losses: list[tuple[int, float]] = field(default_factory=list)
    rewards: list[tuple[int, float]] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    seconds: float = 0.0
    tokens: int = 0
    peak_mib: float | None = None
    eval_loss: float | None = None  # held-out texts, every token (evaluation is never masked); None for GRPO
    report: str = ""
    applied: list[str] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.seconds and self.tokens else None

    @property
    def final_loss(self) -> float | None:
        tail = [loss for _, loss in self.losses[-5:]]
        return sum(tail) / len(tail) if tail else None

    @property
    def step_time(self) -> float | None:
        """Median seconds per optimizer step, the first (warm-up) step left out: robust to a shared CPU's noise."""
        times = sorted(self.step_seconds[1:] or self.step_seconds)
        return times[len(times) // 2] if times else None


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


def _dataset(tokenizer, n: int, held_out: bool = False, n_eval: int = 64):
    from datasets import Dataset

    texts = tiny.corpus_texts()
    texts = texts[-n_eval:] if held_out else texts[:-64][:n]  # the last 64 paragraphs are never trained on
    return Dataset.from_dict({"text": texts})


def _prompts(n: int):
    from datasets import Dataset

    texts = tiny.corpus_texts()[:n]
    return Dataset.from_dict({"prompt": [" ".join(t.split()[:12]) for t in texts]})


def letter_reward(completions: list[str], **_: Any) -> list[float]:
    """Toy reward for the GRPO demo: the share of letters and spaces in the completion."""
    return [sum(c.isalpha() or c == " " for c in text) / max(1, len(text)) for text in completions]


def _model(args: argparse.Namespace, vocab_size: int):
    family = DEMO_MODELS[args.model]
    if family != "gpt_oss":
        return tiny.tiny_model(family, seed=args.seed, vocab_size=vocab_size, hidden=args.hidden, layers=4).train()
    if not importlib.util.find_spec("bitsandbytes"):
        raise SystemExit(
            'the gpt-oss demo trains frozen 4-bit experts: install bitsandbytes (pip install -e ".[bnb]"), '
            "or run a dense model: leantrain demo --model llama"
        )
    # Many small experts, each row a whole number of bitsandbytes' 64-element blocks: on CPU the per-expert loop's
    # cost grows with the expert count while the grouped path's barely does.
    model = tiny.tiny_model(
        "gpt_oss",
        seed=args.seed,
        vocab_size=vocab_size,
        hidden=args.hidden,
        layers=2,
        num_local_experts=args.experts,
        intermediate_size=64,
    ).train()
    tiny.linear4bit_experts(model)  # the same frozen nf4 experts in both runs
    tiny.settle_4bit(model)
    return model


def _make_trainer(args: argparse.Namespace, out: Path, run_name: str):
    tokenizer = tiny.train_tokenizer(args.vocab)
    model = _model(args, len(tokenizer))
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

        config = SFTConfig(
            **common, per_device_train_batch_size=args.batch, max_length=args.seq, lr_scheduler_type="constant"
        )
        return SFTTrainer(
            model=model,
            args=config,
            train_dataset=_dataset(tokenizer, args.batch * args.steps),
            eval_dataset=_dataset(tokenizer, 0, held_out=True, n_eval=args.eval_texts),
            processing_class=tokenizer,
        )
    from trl import GRPOConfig, GRPOTrainer

    # beta = 0: no reference model, so the model object is passed as is (its 4-bit experts cannot be saved and
    # reloaded from a path). A GRPO run has no eval loss.
    config = GRPOConfig(**common, per_device_train_batch_size=4, num_generations=4, max_completion_length=24, beta=0.0)
    return GRPOTrainer(
        model=model,
        reward_funcs=letter_reward,
        args=config,
        train_dataset=_prompts(4 * args.steps),
        processing_class=tokenizer,
    )


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """What the patched run asks for: nothing (the defaults) unless --cggr opts into CGGR."""
    if not args.cggr:
        return {}
    return dict(cggr=True, cggr_warmup_steps=max(1, args.steps // 4), cggr_min_tokens_ratio=0.5)


def _run(args: argparse.Namespace, out: Path, patched: bool) -> RunResult:
    name = "leantrain" if patched else "stock"
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer = _make_trainer(args, out, name)
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    result = RunResult(name)
    trainer.add_callback(_Progress(f"{name:>9}", result.step_seconds, quiet=args.smoke))
    report = None
    if patched:
        report = patch_trainer(trainer, **_options(args))
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
        report = current_report(trainer) or report  # after training: a runtime fallback shows as "failed"
        result.report, result.applied = str(report), list(report.applied)
        unpatch_trainer(trainer)
    return result


def _count_tokens(trainer) -> int:
    # TRL logs the running count of input tokens as `num_tokens`.
    return int(max((e.get("num_tokens", 0) for e in trainer.state.log_history), default=0))


class _Progress:
    """A one-line progress bar with the latest loss, in place of the Trainer's per-step log dump; records each
    optimizer step's wall time into ``step_seconds``."""

    def __new__(cls, name: str, step_seconds: list[float], quiet: bool = False):
        from tqdm.auto import tqdm
        from transformers import TrainerCallback

        class Progress(TrainerCallback):
            def on_train_begin(self, args, state, control, **kwargs):
                self.bar = tqdm(total=state.max_steps, desc=name, unit="step", dynamic_ncols=True, disable=quiet)

            def on_step_begin(self, args, state, control, **kwargs):
                self.start = time.perf_counter()

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    extra = {"reward": f"{logs['reward']:.3f}"} if "reward" in logs else {}
                    self.bar.set_postfix(loss=f"{logs['loss']:.3f}", **extra)

            def on_step_end(self, args, state, control, **kwargs):
                step_seconds.append(time.perf_counter() - self.start)
                self.bar.update(state.global_step - self.bar.n)

            def on_train_end(self, args, state, control, **kwargs):
                self.bar.close()

        return Progress()


def _cell(value: float | None, fmt: str) -> str:
    return NO_VALUE if value is None or value != value else format(value, fmt)  # value != value: nan


def _mean_tail(points: list[tuple[int, float]]) -> float | None:
    tail = [v for _, v in points[-5:]]
    return sum(tail) / len(tail) if tail else None


def loss_agreement(stock: RunResult, lean: RunResult) -> tuple[float, float]:
    """(max |stock - leantrain| train loss over the logged steps, the bound LOSS_RTOL x the largest loss)."""
    pairs = list(zip((v for _, v in stock.losses), (v for _, v in lean.losses)))
    if not pairs:
        return float("inf"), 0.0
    return max(abs(a - b) for a, b in pairs), LOSS_RTOL * max(max(abs(a), abs(b)) for a, b in pairs)


def _table(stock: RunResult, lean: RunResult, mem_label: str) -> str:
    ratio = lambda a, b: a / b if a and b else None  # noqa: E731
    rows = [
        ("train loss (mean of last 5 logs)", _cell(stock.final_loss, ".4f"), _cell(lean.final_loss, ".4f"), ""),
        ("eval loss, held-out, all tokens", _cell(stock.eval_loss, ".4f"), _cell(lean.eval_loss, ".4f"), ""),
        (
            "time per step (s, median)",
            _cell(stock.step_time, ".3f"),
            _cell(lean.step_time, ".3f"),
            _cell(ratio(stock.step_time, lean.step_time), ".2f") + "x faster",
        ),
        ("train time (s)", _cell(stock.seconds, ".1f"), _cell(lean.seconds, ".1f"), ""),
        ("tokens/s", _cell(stock.tokens_per_s, ",.0f"), _cell(lean.tokens_per_s, ",.0f"), ""),
        (mem_label, _cell(stock.peak_mib, ",.0f"), _cell(lean.peak_mib, ",.0f"), ""),
    ]
    if stock.rewards:
        rows.append(
            (
                "reward (mean of last 5 logs)",
                _cell(_mean_tail(stock.rewards), ".3f"),
                _cell(_mean_tail(lean.rewards), ".3f"),
                "",
            )
        )
    header = ("", "stock", "leantrain", "ratio")
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *rows])


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
                style = dict(linestyle="-", linewidth=3, alpha=0.5) if run.name == "stock" else dict(linestyle="--")
                ax.plot(steps, values, label=run.name, **style)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="leantrain demo")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 20; --smoke 3)")
    parser.add_argument(
        "--model",
        choices=sorted(DEMO_MODELS),
        default="gpt-oss",
        help="gpt-oss (default): a MoE with frozen 4-bit experts, where the defaults' grouped experts pay off",
    )
    parser.add_argument("--trainer", choices=("sft", "grpo"), default="sft")
    parser.add_argument(
        "--cggr",
        action="store_true",
        help="also run CGGR (opt-in, changes which tokens train: the loss curves are no longer expected to match)",
    )
    parser.add_argument("--smoke", action="store_true", help="a few seconds: tiny shapes and 3 steps (tests)")
    parser.add_argument("--out", type=Path, default=Path("leantrain-demo"), help="where the PNG and JSON go")
    parser.add_argument("--seq", type=int, default=None, help="max sequence length (sft; default 128, --smoke 32)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (sft)")
    parser.add_argument("--experts", type=int, default=None, help="experts per layer (gpt-oss; default 32)")
    parser.add_argument("--hidden", type=int, default=64, help="hidden size (a multiple of 64 for gpt-oss)")
    parser.add_argument("--vocab", type=int, default=None, help="tokenizer vocabulary (default 2048, --smoke 512)")
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that --smoke shrinks."""
    smoke = bool(getattr(args, "smoke", False))
    for name, full, small in (("steps", 20, 3), ("seq", 128, 32), ("experts", 32, 8), ("vocab", 2048, 512)):
        if getattr(args, name, None) is None:
            setattr(args, name, small if smoke else full)
    args.smoke, args.cggr = smoke, bool(getattr(args, "cggr", False))
    args.eval_texts = 16 if smoke else 64
    if getattr(args, "batch", None) is None:
        args.batch = 8
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    return args


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    args = _resolve(args)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    stock = _run(args, out, patched=False)
    lean = _run(args, out, patched=True)
    mem_label = "peak CUDA memory (MiB)" if torch.cuda.is_available() else "peak process RSS (MiB)"
    print("\n" + lean.report + "\n")
    print(_table(stock, lean, mem_label))
    diff, bound = loss_agreement(stock, lean)
    if args.cggr:
        verdict = "CGGR is on (opt-in, changes which tokens train): the curves are not expected to match"
    else:
        verdict = "match" if diff <= bound else "DIFFER (please report this)"
    print(
        f"\ntrain loss, stock vs leantrain: max |difference| over {len(lean.losses)} steps = {diff:.2e} "
        f"(bound {bound:.2e} = {LOSS_RTOL:g} x loss): {verdict}"
    )
    png = out / "loss_curve.png"
    title = f"leantrain demo: tiny {args.model}, {args.trainer}, {args.steps} steps"
    _plot(stock, lean, png, title + (" (CGGR on)" if args.cggr else " (defaults)"))
    summary = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "stock": asdict(stock),
        "leantrain": asdict(lean),
        "loss_max_abs_diff": diff,
        "loss_bound": bound,
        "step_time_ratio": stock.step_time / lean.step_time if stock.step_time and lean.step_time else None,
    }
    (out / "demo.json").write_text(json.dumps(summary, indent=1))
    print(f"\nloss curve: {png}\nsummary:    {out / 'demo.json'}")
    return summary
