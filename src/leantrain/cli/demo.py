"""`leantrain demo`: train a tiny model stock and patched with leantrain's defaults, measured as `leantrain compare`
measures a run, and say what it buys.

The default shows what ``patch_trainer(trainer)`` does with no options: a tiny gpt-oss MoE whose 32 experts are
frozen nf4 ``Linear4bit`` lists (the layout of community pre-quantized gpt-oss checkpoints) trains with the grouped
4-bit experts (moe4bit) in place of the per-expert loop. CGGR changes which tokens train: it runs only with
``--cggr``. ``--trainer grpo`` trains with TRL's GRPOTrainer on 8 experts a layer (generation included), where
the grouped experts measured faster on CPU too; the fused log-probs apply there on CUDA.

Four runs in one process, in the order stock, leantrain, leantrain, stock (neither mode always meets the first-time
costs), each measured by the clock of ``leantrain compare`` (``_measure``): step time from each run's steady state
on (detected from its own step times, as compare does), peak memory, tokens/s, per-step losses. The verdict is
compare's: a speed claim only outside the measured spread and from runs that had settled, the losses against a bound
derived from the dtype's rounding, "nothing applied" when nothing did. GRPO samples its completions: every run
trains on the completions the first stock run sampled (each run still samples, so its step time includes
generation), so the losses compare what the optimizations change and not which tokens were sampled.

Everything is local: the model is built from a config (random init), the tokenizer is trained on Python's own
documentation, and the training text is the same documentation. Writes a PNG (loss curves, step times) and a JSON
summary into ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ._measure import Completions, Measurement, measure_run
from .plot import plot
from .printing import metric_lines, report_text, table
from .runs import Progress
from .verdict import MIN_STEPS, MIN_TIMED, MODES, ORDER, STEADY_RULE, quantile, steady_state, verdict


DEMO_MODELS = {"llama": "llama", "gpt2": "gpt2", "gpt-oss": "gpt_oss"}
NO_VALUE = "—"  # a table cell with nothing to show (a GRPO run has no eval loss): never "nan"
# Defaults: (sft, grpo, --smoke). Steps: enough that each run settles well inside the half the steady-state cut may
# leave out. On 2 idle CPU cores stock SFT's step time falls for its first 6-8 steps, then holds: 30 steps. Stock
# GRPO's keeps drifting down for tens of steps while leantrain's holds from step 2: 60 steps. --smoke takes the
# fewest steps the cut allows.
# A GRPO step samples its completions token by token, and on CPU that dominates the step: fewer experts keep it short.
# --smoke keeps each trainer's expert count (None): the counts where the grouped experts measured faster on a CPU, so
# auto mode applies them in the smoke run too.
SIZES = {"steps": (30, 60, MIN_STEPS), "seq": (128, 128, 32), "experts": (32, 8, None), "vocab": (2048, 2048, 512)}
MIN_VOCAB = 259  # the tokenizer's 256 byte tokens and its 3 special tokens


def _dataset(tokenizer, n: int, held_out: bool = False, n_eval: int = 64):
    from datasets import Dataset

    from . import tiny

    texts = tiny.corpus_texts()
    texts = texts[-n_eval:] if held_out else texts[:-64][:n]  # the last 64 paragraphs are never trained on
    return Dataset.from_dict({"text": texts})


def _prompts(n: int):
    from datasets import Dataset

    from . import tiny

    texts = tiny.corpus_texts()[:n]
    return Dataset.from_dict({"prompt": [" ".join(t.split()[:12]) for t in texts]})


def letter_reward(completions: list[str], **_: Any) -> list[float]:
    """Toy reward for the GRPO demo: the share of letters and spaces in the completion."""
    return [sum(c.isalpha() or c == " " for c in text) / max(1, len(text)) for text in completions]


def _model(args: argparse.Namespace, vocab_size: int):
    from . import tiny

    family = DEMO_MODELS[args.model]
    if family != "gpt_oss":
        return tiny.tiny_model(family, seed=args.seed, vocab_size=vocab_size, hidden=args.hidden, layers=4).train()
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
    tiny.linear4bit_experts(model)  # the same frozen nf4 experts in every run
    tiny.settle_4bit(model)
    return model


def _make_trainer(args: argparse.Namespace, output_dir: str):
    import torch

    from . import tiny

    tokenizer = tiny.train_tokenizer(args.vocab)
    model = _model(args, len(tokenizer))
    cuda = torch.cuda.is_available()
    common = dict(
        output_dir=output_dir,
        bf16=cuda,  # fp32 on CPU (TRL's configs default to bf16, which a CPU without bf16 units runs slowly)
        max_steps=args.steps,
        learning_rate=args.lr,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=args.seed,
        use_cpu=not cuda,
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


def _run(
    args: argparse.Namespace, index: int, progress: Progress, completions: Completions | None
) -> tuple[Measurement, float | None]:
    """One run (ORDER[index]): build, patch (leantrain runs), train measured, evaluate; (measurement, eval loss)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from ..entry import current_report, patch_trainer, unpatch_trainer

    mode = ORDER[index]
    label = f"{mode} {1 + ORDER[:index].count(mode)}"
    head = f"[{index + 1}/{len(ORDER)}] {mode}"
    with tempfile.TemporaryDirectory(prefix="leantrain-demo-") as output_dir:  # the trainers save nothing
        trainer = _make_trainer(args, output_dir)
        trainer.remove_callback(ProgressCallback)
        trainer.remove_callback(PrinterCallback)
        if mode == "leantrain":
            patch_trainer(trainer, **_options(args))

        def show(k: int, n: int, result: Measurement) -> None:
            progress.show(f"{head}: step {k} of {n} ({result.step_ms[-1]:.0f} ms)")

        result = measure_run(
            trainer,
            trainer.train,
            args.steps,
            label,
            show,
            completions,
            report=lambda: current_report(trainer),
        )
        eval_loss = float(trainer.evaluate()["eval_loss"]) if trainer.eval_dataset is not None else None
        if mode == "leantrain":
            unpatch_trainer(trainer)
    cut = steady_state(result.step_ms).cut
    median = quantile(result.step_ms[cut:], 0.5)
    progress.done(f"{head}: {len(result.step_ms)} steps, median {median:.0f} ms from step {cut + 1} on")
    gc.collect()
    return result, eval_loss


@contextlib.contextmanager
def _quiet_datasets() -> Iterator[None]:
    """No progress bars from the datasets library while the four runs build their trainers (one line per run)."""
    import datasets

    was_on = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if was_on:
            datasets.enable_progress_bars()


def _cell(value: float | None, fmt: str) -> str:
    return NO_VALUE if value is None or value != value else format(value, fmt)  # value != value: nan


def _mean_tail(values: list[float | None]) -> float | None:
    tail = [v for v in values[-5:] if v is not None]
    return sum(tail) / len(tail) if tail else None


def extra_rows(runs: list[Measurement], evals: list[float | None]) -> list[tuple[str, str, str]]:
    """The demo's rows beyond compare's table: held-out eval loss, and GRPO's reward."""
    first = {m: ORDER.index(m) for m in MODES}
    rows = [("eval loss, held-out, all tokens", *(_cell(evals[first[m]], ".4f") for m in MODES))]
    if any("reward" in r.metrics for r in runs):
        rewards = (_cell(_mean_tail(runs[first[m]].metrics.get("reward", [])), ".3f") for m in MODES)
        rows.append(("reward (mean of last 5 steps)", *rewards))
    return rows


def _steps_problem(steps: int) -> str | None:
    if steps >= MIN_STEPS:
        return None
    return (
        f"--steps must be >= {MIN_STEPS}, got {steps}: each run's steady state is detected by leaving out up to half "
        f"of its steps, and a speed claim needs {MIN_TIMED} timed steps a run"
    )


def _steps(text: str) -> int:
    """--steps, refused by the parser (exit 2) below what the steady-state detection needs."""
    try:
        steps = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of steps, got {text!r}") from None
    problem = _steps_problem(steps)
    if problem:
        raise argparse.ArgumentTypeError(problem.removeprefix("--steps "))
    return steps


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    parser = parser or argparse.ArgumentParser(prog="leantrain demo")
    sft, grpo, smoke = SIZES["steps"]
    default = f"default {sft}" if sft == grpo else f"default {sft}, grpo {grpo}"
    parser.add_argument(
        "--steps",
        type=_steps,
        default=None,
        help=f"optimizer steps per run, 4 runs ({default}; --smoke {smoke}; at least {MIN_STEPS}: each run is timed "
        "from its steady state, detected from its own step times)",
    )
    parser.add_argument(
        "--model",
        choices=sorted(DEMO_MODELS),
        default="gpt-oss",
        help="gpt-oss (default): a MoE with frozen 4-bit experts, where the defaults' grouped experts pay off",
    )
    parser.add_argument(
        "--trainer",
        choices=("sft", "grpo"),
        default="sft",
        help="sft (default): TRL SFTTrainer on text; grpo: TRL GRPOTrainer with a toy reward, where the fused "
        "log-probs apply too",
    )
    parser.add_argument(
        "--cggr",
        action="store_true",
        help="also run CGGR (opt-in, changes which tokens train: the loss curves are no longer expected to match)",
    )
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"tiny shapes and {SIZES['steps'][2]} steps per run (tests; under a minute on 2 CPU cores)",
    )
    parser.add_argument("--out", type=Path, default=Path("leantrain-demo"), help="where the PNG and JSON go")
    parser.add_argument("--seq", type=int, default=None, help="max sequence length (sft; default 128, --smoke 32)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per step (sft)")
    parser.add_argument("--experts", type=int, default=None, help="experts per layer (gpt-oss; default 32, grpo 8)")
    parser.add_argument(
        "--hidden", type=int, default=64, help="hidden size: a multiple of 32 (of 64 for gpt-oss); default 64"
    )
    parser.add_argument(
        "--vocab", type=int, default=None, help=f"tokenizer vocabulary, >= {MIN_VOCAB} (default 2048, --smoke 512)"
    )
    parser.add_argument("--lr", type=float, default=2e-3, help="learning rate (default 2e-3)")
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the model's initialization and the Trainer (default 0)"
    )
    return parser


def _check(args: argparse.Namespace) -> None:
    """Every size checked before anything is built: a clear message instead of a traceback from deep inside."""
    problems = [problem] if (problem := _steps_problem(args.steps)) else []
    multiple = 64 if args.model == "gpt-oss" else 32
    if args.hidden < multiple or args.hidden % multiple:
        why = " (bitsandbytes' 4-bit blocks)" if multiple == 64 else " (attention heads of 32)"
        problems.append(f"--hidden must be a multiple of {multiple} for --model {args.model}{why}, got {args.hidden}")
    if args.seq < 8:
        problems.append(f"--seq must be >= 8, got {args.seq}")
    if args.batch < 1:
        problems.append(f"--batch must be >= 1, got {args.batch}")
    if args.experts < 2:
        problems.append(f"--experts must be >= 2 (each token picks 2), got {args.experts}")
    if args.vocab < MIN_VOCAB:
        problems.append(f"--vocab must be >= {MIN_VOCAB} (256 bytes and 3 special tokens), got {args.vocab}")
    if not args.lr > 0:
        problems.append(f"--lr must be > 0, got {args.lr}")
    if args.model == "gpt-oss" and not importlib.util.find_spec("bitsandbytes"):
        from ..optimization import install_command

        problems.append(
            f"the gpt-oss demo trains frozen 4-bit experts: install bitsandbytes ({install_command('bnb')}), "
            "or run a dense model: leantrain demo --model llama"
        )
    if problems:
        raise SystemExit("leantrain demo: error: " + "; ".join(problems))


def _resolve(args: argparse.Namespace) -> argparse.Namespace:
    """Fill the defaults that --smoke shrinks, then check every size."""
    smoke = bool(getattr(args, "smoke", False))
    args.trainer = getattr(args, "trainer", None) or "sft"
    for name, (sft, grpo, small) in SIZES.items():
        if getattr(args, name, None) is None:
            default = grpo if args.trainer == "grpo" else sft
            setattr(args, name, small if smoke and small is not None else default)
    args.smoke, args.cggr = smoke, bool(getattr(args, "cggr", False))
    args.eval_texts = 16 if smoke else 64
    for name, default in (("batch", 8), ("hidden", 64), ("lr", 2e-3), ("seed", 0), ("model", "gpt-oss")):
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    _check(args)
    return args


def run_demo(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    args = _resolve(args)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))
    print(
        f"leantrain demo: {args.steps} steps of {args.trainer} on a tiny {args.model}, 4 runs in this order: "
        f"{', '.join(ORDER)}; {STEADY_RULE}",
        flush=True,
    )
    grpo = args.trainer == "grpo"
    recorded = Completions("record") if grpo else None
    progress = Progress()
    runs, evals = [], []
    with _quiet_datasets():
        for index in range(len(ORDER)):
            completions = recorded if index == 0 or recorded is None else Completions("replay", calls=recorded.calls)
            result, eval_loss = _run(args, index, progress, completions)
            runs.append(result)
            evals.append(eval_loss)
    result = verdict(runs)
    print("\n== what leantrain applied (the leantrain runs' patch report) ==\n" + report_text(runs))
    if grpo:
        print("\nGRPO: every run trained on the completions the first stock run sampled (each run still samples)")
    print(f"\n== measured ({runs[1].device}, {runs[1].dtype}; 2 runs per mode) ==")
    print(table(runs, result, extra_rows(runs, evals)))
    losses = result["losses"]
    diffs = [d for d in losses["diff"] if d is not None]
    worst = max(range(len(diffs)), key=lambda k: diffs[k] / (losses["bound"][k] or 1e-30)) if diffs else None
    if worst is not None:
        print(
            f"\ntrain loss, stock vs leantrain: max |difference| over {len(diffs)} steps = {max(diffs):.2e}; "
            f"closest to its bound at step {worst + 1}: {diffs[worst]:.2e} of {losses['bound'][worst]:.2e} "
            f"({losses['rule']})"
        )
    for line in metric_lines(result):
        print(line)
    if args.cggr:
        print("CGGR is on (opt-in, changes which tokens train): the curves are not expected to match")
    print(f"\nverdict: {result['text']}")
    png = out / "demo.png"
    title = f"leantrain demo: tiny {args.model}, {args.trainer}, {args.steps} steps per run"
    plot(runs, result, str(png), title + (" (CGGR on)" if args.cggr else " (defaults)"))
    summary = {
        "args": {k: str(v) for k, v in vars(args).items()},
        "order": list(ORDER),
        "runs": [r.to_json() for r in runs],
        "eval_loss": evals,
        "verdict": result,
    }
    (out / "demo.json").write_text(json.dumps(summary, indent=1))
    print(f"\nplot:    {png}\nsummary: {out / 'demo.json'}")
    return summary
