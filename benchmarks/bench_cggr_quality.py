"""CGGR fine-tuning quality study: does keeping labels only on the "hardest" tokens help or hurt a fine-tune?

1. Pretrain a ~34M-parameter Llama-shaped model (random init, ``from_config``) on the Python standard library's own
   ``.py`` sources (time-boxed, cosine schedule over the time box; the held-out curve shows whether it flattened), with
   a byte-level BPE tokenizer trained here on both sources. Nothing is downloaded.
2. Fine-tune that model for one epoch on a different source, Python's English documentation (``pydoc_data.topics``),
   through a transformers ``Trainer`` patched with ``leantrain.patch_trainer(trainer, cggr=True, ...)`` (the product
   path: in-forward router hook, kept-rows LM head), one run per cell and seed:
   stock; CGGR at ratios 0.25 and 0.5 for each scoring (entropy, margin, loss, combined) with the router after decoder
   layer 2, after the middle layer and on the final hidden state (-1); and the random-selection control.
3. Report held-out loss over all tokens on the fine-tune source and on the pretraining source (forgetting), at equal
   steps (end of the epoch) and at equal wall-clock (each run's eval curve interpolated at the time the fastest cell
   finished), mean ± std over seeds (and min/max in the JSON), plus the step time of each cell.

    python benchmarks/bench_cggr_quality.py            # CUDA, under 8 minutes on an H100
    python benchmarks/bench_cggr_quality.py --smoke    # CPU, tiny sizes (< 60 s)

Writes ``cggr_quality.json`` / ``.md`` / ``.png`` into ``$BENCH_RESULTS`` or ``benchmarks/results/``. The
pretrained model is saved under ``--work`` (reuse it with ``--pretrained``).
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import statistics
import sysconfig
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from _harness import RESULTS, Row, markdown_table, write_results  # noqa: E402

import leantrain  # noqa: E402
from testkit.optimizations import others_off  # noqa: E402


OFF = others_off("cggr")
SCORINGS = ("entropy", "margin", "loss", "combined")
START = time.perf_counter()


@dataclass(frozen=True)
class Plan:
    """Sizes of one study. ``FULL`` fits 8 minutes on an H100; ``SMOKE`` a minute on a loaded CPU."""

    vocab: int = 8192
    hidden: int = 512
    layers: int = 8
    intermediate: int = 1536
    heads: int = 8
    kv_heads: int = 4
    seq: int = 256
    code_mb: float = 12.0  # stdlib source read for pretraining (the whole library is ~12 MB without tests)
    pt_batch: int = 64
    pt_lr: float = 1e-3
    pt_seconds: float = 60.0  # time box; on an H100 the held-out loss bottoms out at ~40 s (2.5M tokens, 34M params)
    pt_steps: int | None = None  # a step budget instead (the time box then only caps it): the same model on any CPU
    pt_evals: int = 15
    pt_patience: int = 3  # stop after this many evals without a new best held-out loss (it overfits after)
    ft_batch: int = 8
    ft_lr: float = 3e-4
    ft_evals: int = 6  # eval points per fine-tune run (plus the shared step-0 point)
    cggr_warmup_frac: float = 0.1  # CGGR's warmup (all labels) as a fraction of the fine-tune's optimizer steps
    eval_blocks: int = 64
    ft_blocks: int | None = None  # cap on the fine-tune set (smoke only; the study uses one whole epoch)
    seeds: int = 3
    ratios: tuple[float, ...] = (0.25, 0.5)
    scorings: tuple[str, ...] = SCORINGS
    budget_s: float = 470.0  # stop starting new fine-tune runs after this (whole seeds first, so cells stay even)
    smoke: bool = False


FULL = Plan()
SMOKE = Plan(
    vocab=512,
    hidden=64,
    layers=6,
    intermediate=128,
    heads=2,
    kv_heads=1,
    seq=64,
    code_mb=0.3,
    pt_batch=8,
    pt_lr=3e-3,
    pt_seconds=600.0,
    pt_steps=120,  # ~4 s on a CPU core; a step budget, not a time box, so the smoke's numbers do not follow the load
    pt_evals=3,
    ft_batch=8,
    ft_evals=2,
    eval_blocks=8,
    ft_blocks=128,  # 16 steps: with 4 the held-out loss moved by ~1e-3, less than the seeds differ
    seeds=2,
    ratios=(0.5,),
    scorings=("entropy", "loss"),
    budget_s=50.0,
    smoke=True,
)


@dataclass(frozen=True)
class Cell:
    label: str
    scoring: str | None = None  # None: stock
    ratio: float | None = None
    depth: int | None = None  # cggr_router_layers


def cells(plan: Plan) -> list[Cell]:
    """stock, the random control per ratio, then scoring x ratio x router depth (2, middle, -1)."""
    depths = sorted({2, plan.layers // 2}) + [-1]
    out = [Cell("stock")]
    out += [Cell(f"random@{r}", "random", r, 2) for r in plan.ratios]
    for ratio in plan.ratios:
        for scoring in plan.scorings:
            for depth in depths:
                out.append(Cell(f"{scoring}@{ratio} L{depth}", scoring, ratio, depth))
    if plan.smoke:  # a few cells that still cover every scoring path and depth kind
        keep = {"stock", "random@0.5", "entropy@0.5 L2", "entropy@0.5 L3", "loss@0.5 L-1"}
        out = [c for c in out if c.label in keep]
    return out


# ---- data: two sources that ship with Python ---------------------------------------------------------------------
def code_texts(limit_mb: float) -> list[str]:
    """The standard library's own sources (no tests, no pydoc_data: that is the other source), sorted by path."""
    root = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(root, "**", "*.py"), recursive=True))
    skip = ("site-packages", "dist-packages", f"{os.sep}test", "pydoc_data", "idlelib")
    texts, size = [], 0
    for path in files:
        if any(s in path for s in skip):
            continue
        text = Path(path).read_text(encoding="utf-8", errors="replace")
        texts.append(text)
        size += len(text)
        if size >= limit_mb * 1e6:
            break
    if size < 0.1e6 * min(limit_mb, 1.0):
        raise RuntimeError(f"found only {size} bytes of standard-library sources under {root}")
    return texts


def doc_texts() -> list[str]:
    """Python's English documentation topics, one text per topic (sorted keys)."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def train_tokenizer(texts: list[str], vocab: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|pad|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def blocks_of(tok, texts: list[str], seq: int) -> torch.Tensor:
    """Documents joined with end-of-text, cut into [n, seq] blocks (every position labelled)."""
    eos = tok.token_to_id("<|endoftext|>")
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids += enc.ids + [eos]
    n = len(ids) // seq
    return torch.tensor(ids[: n * seq], dtype=torch.long).view(n, seq)


def split(texts: list[str], every: int) -> tuple[list[str], list[str]]:
    """(train, held out): every ``every``-th document is held out (whole documents, so no block straddles)."""
    return [t for i, t in enumerate(texts) if i % every], [t for i, t in enumerate(texts) if i % every == 0]


def shuffled(blocks: torch.Tensor, seed: int) -> torch.Tensor:
    return blocks[torch.randperm(blocks.shape[0], generator=torch.Generator().manual_seed(seed))]


# ---- model, evaluation -------------------------------------------------------------------------------------------
def build_model(plan: Plan, device: str):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=plan.vocab,
        hidden_size=plan.hidden,
        intermediate_size=plan.intermediate,
        num_hidden_layers=plan.layers,
        num_attention_heads=plan.heads,
        num_key_value_heads=plan.kv_heads,
        max_position_embeddings=plan.seq,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: fast, and every fine-tune run loads the same state
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def autocast(device: str):
    return torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" else torch.autocast("cpu", enabled=False)


@torch.no_grad()
def heldout_loss(model, blocks: torch.Tensor, device: str, batch: int = 32) -> float:
    """Mean next-token cross-entropy over every held-out token (fp32 logits)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, blocks.shape[0], batch):
        ids = blocks[start : start + batch].to(device)
        with autocast(device):
            logits = model(input_ids=ids).logits
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].float().flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"
        )
        total += loss.item()
        count += ids[:, 1:].numel()
    model.train(was_training)
    return total / count


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---- 1. pretraining (a plain loop: this part is not what the study measures) -------------------------------------
def pretrain(plan: Plan, train: torch.Tensor, held: torch.Tensor, device: str) -> tuple[Any, list[tuple], tuple]:
    """Time-boxed pretraining: linear warmup, then cosine decay over the time box (over ``pt_steps`` when set: the
    same run on any machine). Early stopping: returns the model at its lowest held-out loss (and that curve point),
    stopping once ``pt_patience`` evals in a row found no new best, because the small corpus overfits."""
    model = build_model(plan, device).train()
    opt = torch.optim.AdamW(
        model.parameters(), lr=plan.pt_lr, betas=(0.9, 0.95), weight_decay=0.1, fused=device == "cuda"
    )
    gen = torch.Generator().manual_seed(0)
    order = torch.randperm(train.shape[0], generator=gen)
    curve, step, cursor, next_eval = [], 0, 0, 0.0
    best: tuple[tuple, dict] = ((0, 0.0, math.inf), {})
    sync(device)
    t0 = time.perf_counter()
    while True:
        elapsed = time.perf_counter() - t0
        frac = min(1.0, elapsed / plan.pt_seconds)
        if plan.pt_steps:  # the step budget sets the schedule and the eval points; the time box only caps it
            frac = 1.0 if frac >= 1.0 else min(1.0, step / plan.pt_steps)
        if frac >= next_eval or frac >= 1.0:
            loss = heldout_loss(model, held, device)
            curve.append((step, round(elapsed, 2), loss))
            print(f"  pretrain step {step:5d}  {elapsed:6.1f} s  held-out loss {loss:.3f}", flush=True)
            next_eval += 1.0 / plan.pt_evals
            if loss < best[0][2]:
                best = (curve[-1], {k: v.detach().clone() for k, v in model.state_dict().items()})
            if frac >= 1.0 or len(curve) - curve.index(best[0]) > plan.pt_patience:
                break
        warm = min(1.0, (step + 1) / 100)
        lr = plan.pt_lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        for group in opt.param_groups:
            group["lr"] = lr
        if cursor + plan.pt_batch > train.shape[0]:
            order, cursor = torch.randperm(train.shape[0], generator=gen), 0
        ids = train[order[cursor : cursor + plan.pt_batch]].to(device, non_blocking=True)
        cursor += plan.pt_batch
        with autocast(device):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
    model.load_state_dict(best[1])
    return model, curve, best[0]


# ---- 2. fine-tuning through the product path ---------------------------------------------------------------------
class _Blocks(torch.utils.data.Dataset):
    def __init__(self, blocks: torch.Tensor) -> None:
        self.blocks = blocks

    def __len__(self) -> int:
        return self.blocks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.blocks[i], "labels": self.blocks[i]}


def _clock(every: int, evaluate, device: str):
    """A callback that evaluates every ``every`` optimizer steps and at the end, and measures training time only
    (one device sync per eval point; eval time is excluded)."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.curve: list[tuple[int, float, float, float]] = []
            self.start = self.paused = 0.0

        def on_train_begin(self, args, state, control, **kwargs):
            sync(device)
            self.start, self.paused = time.perf_counter(), 0.0

        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step % every and state.global_step != state.max_steps:
                return
            sync(device)
            now = time.perf_counter()
            ft, pt = evaluate(model)
            self.curve.append((state.global_step, now - self.start - self.paused, ft, pt))
            self.paused += time.perf_counter() - now

    return Clock()


def finetune(plan: Plan, cell: Cell, seed: int, base_state: dict, data: dict, device: str, work: Path) -> dict:
    from transformers import Trainer, TrainingArguments

    model = build_model(plan, device)
    model.load_state_dict(base_state)
    model.train()
    steps = len(data["ft_train"]) // plan.ft_batch
    args = TrainingArguments(
        output_dir=str(work / "ft"),
        per_device_train_batch_size=plan.ft_batch,
        num_train_epochs=1,
        learning_rate=plan.ft_lr,
        lr_scheduler_type="cosine",
        warmup_steps=max(1, steps // 10),
        weight_decay=0.0,
        bf16=device == "cuda",
        use_cpu=device == "cpu",
        logging_steps=10**6,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=seed,
        data_seed=seed,
        dataloader_num_workers=0,
        dataloader_drop_last=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=data["ft_train"])
    if cell.scoring is not None:
        report = leantrain.patch_trainer(
            trainer,
            cggr=True,
            cggr_min_tokens_ratio=cell.ratio,
            cggr_scoring=cell.scoring,
            cggr_router_layers=cell.depth,
            cggr_warmup_steps=max(1, round(plan.cggr_warmup_frac * steps)),
            **OFF,
        )
        assert report["cggr"].status.value == "applied", str(report)

    def evaluate(m) -> tuple[float, float]:
        return heldout_loss(m, data["ft_held"], device), heldout_loss(m, data["pt_held"], device)

    clock = _clock(max(1, steps // plan.ft_evals), evaluate, device)
    trainer.add_callback(clock)
    trainer.train()
    # CGGR adds its kept fraction (since the last log: here the whole run, warmup included) to the final train log
    kept = next((h["cggr/kept_fraction"] for h in trainer.state.log_history if "cggr/kept_fraction" in h), 1.0)
    leantrain.unpatch_trainer(trainer)
    curve = [(0, 0.0, data["ft0"], data["pt0"]), *clock.curve]
    last = curve[-1]
    return {"curve": curve, "steps": last[0], "seconds": last[1], "ms_per_step": 1e3 * last[1] / last[0], "kept": kept}


def interpolate(curve: list[tuple], t: float, column: int) -> float:
    """Held-out loss of ``column`` at training time ``t`` (linear between eval points; clamped at the ends)."""
    times = [p[1] for p in curve]
    values = [p[column] for p in curve]
    if t >= times[-1]:
        return values[-1]
    i = next(k for k in range(1, len(times)) if times[k] >= t)
    w = (t - times[i - 1]) / max(times[i] - times[i - 1], 1e-12)
    return values[i - 1] + w * (values[i] - values[i - 1])


# ---- 3. report ---------------------------------------------------------------------------------------------------
def summarize(values: list[float]) -> dict[str, Any]:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "values": values,
    }


def aggregate(plan: Plan, runs: dict[str, list[dict]], all_cells: list[Cell]) -> tuple[list[dict], float]:
    """One record per cell: held-out losses at equal steps and at the equal wall-clock time ``t_star`` (the
    fastest cell's mean training time), and speed."""
    done = [c for c in all_cells if runs.get(c.label)]
    t_star = min(statistics.fmean(r["seconds"] for r in runs[c.label]) for c in done)
    records = []
    for cell in done:
        rs = runs[cell.label]
        records.append(
            {
                "cell": cell,
                "seeds": len(rs),
                "ft_steps": summarize([r["curve"][-1][2] for r in rs]),
                "pt_steps": summarize([r["curve"][-1][3] for r in rs]),
                "ft_time": summarize([interpolate(r["curve"], t_star, 2) for r in rs]),
                "pt_time": summarize([interpolate(r["curve"], t_star, 3) for r in rs]),
                "ms_per_step": summarize([r["ms_per_step"] for r in rs]),
                "kept": summarize([r["kept"] for r in rs]),
                "curves": [r["curve"] for r in rs],
            }
        )
    return records, t_star


def pm(s: dict) -> str:
    return f"{s['mean']:.3f} ± {s['std']:.3f}"


def report(plan: Plan, records: list[dict], t_star: float, meta: dict, out: Path) -> Path:
    stock = next((r for r in records if r["cell"].scoring is None), None)
    rows: list[Row] = []
    table = []
    for rec in records:
        cell = rec["cell"]
        cfg = {
            "scoring": cell.scoring,
            "ratio": cell.ratio,
            "router_layers": cell.depth,
            "seeds": rec["seeds"],
            "t_star_s": t_star,
            **meta,
        }
        for key, name in (("ft_steps", "finetune@equal_steps"), ("pt_steps", "pretrain@equal_steps"),
                          ("ft_time", "finetune@equal_time"), ("pt_time", "pretrain@equal_time")):  # fmt: skip
            s = rec[key]
            rows.append(
                Row(
                    "cggr_quality",
                    cell.label,
                    "finetune",
                    "quality",
                    "held-out loss",
                    "measure",
                    name,
                    s["mean"],
                    s["min"],
                    s["max"],
                    config={**cfg, "std": s["std"], "per_seed": s["values"]},
                )
            )
        speed = rec["ms_per_step"]
        rows.append(
            Row("cggr_quality", cell.label, "finetune", "speed", "ms/step", "measure", "train step", speed["mean"],
                speed["min"], speed["max"], config={**cfg, "std": speed["std"], "per_seed": speed["values"],
                                                    "kept_fraction": rec["kept"]["mean"], "curves": rec["curves"]})
        )  # fmt: skip
        rel = stock["ms_per_step"]["mean"] / speed["mean"] if stock else float("nan")
        table.append(
            [
                cell.label,
                rec["seeds"],
                pm(rec["ft_steps"]),
                pm(rec["pt_steps"]),
                pm(rec["ft_time"]),
                pm(rec["pt_time"]),
                f"{speed['mean']:.1f}",
                f"{rel:.2f}x",
                f"{rec['kept']['mean']:.2f}",
            ]
        )
    header = [
        "cell",
        "seeds",
        "fine-tune loss, equal steps",
        "pretrain loss, equal steps",
        f"fine-tune loss, at {t_star:.1f} s",
        f"pretrain loss, at {t_star:.1f} s",
        "ms/step",
        "speed vs stock",
        "kept",
    ]
    text = (
        f"Pretrained model: {meta['params_m']:.1f}M parameters (Llama, {plan.layers} layers, hidden {plan.hidden}, "
        f"vocab {plan.vocab}), {meta['pt_steps']} steps in {meta['pt_seconds']:.0f} s on {meta['pt_tokens_m']:.1f}M "
        f"tokens of standard-library source; held-out loss curve (step, s, loss): {meta['pt_curve']}; fine-tuning "
        f"starts from the lowest point, step {meta['pt_best'][0]} (held-out loss {meta['pt_best'][2]}).\n\n"
        f"Fine-tune: one epoch ({meta['ft_steps']} steps of {plan.ft_batch}x{plan.seq} tokens) on Python's "
        f"documentation topics, lr {plan.ft_lr} cosine, bf16 autocast on CUDA; CGGR warmup {meta['cggr_warmup']} "
        "steps; transformers Trainer + leantrain.patch_trainer(cggr=True, ...). Held-out loss over all tokens of "
        "held-out documents: fine-tune source and pretraining source (forgetting). Equal steps = end of the epoch; "
        f"equal wall-clock = each run's eval curve interpolated at {t_star:.1f} s of training (the fastest cell's "
        "mean). Mean ± std over seeds (per-seed values, min/max and eval curves in the JSON). `kept` = kept label "
        "fraction over the whole run, warmup included.\n\n"
    )
    text += markdown_table(header, table)
    out = write_results("cggr_quality", rows, text, out)
    plot(records, out / "cggr_quality.png", plan)
    return out


def _mean_curve(curves: list[list[tuple]], column: int, points: int = 40) -> tuple[list[float], list[float]]:
    end = statistics.fmean(c[-1][1] for c in curves)
    grid = [end * i / (points - 1) for i in range(points)]
    return grid, [statistics.fmean(interpolate(c, t, column) for c in curves) for t in grid]


def plot(records: list[dict], path: Path, plan: Plan) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    colors = {"entropy": "tab:blue", "margin": "tab:orange", "loss": "tab:red", "combined": "tab:purple"}
    styles = {2: "-", -1: ":"}
    fig, axes = plt.subplots(2, len(plan.ratios), figsize=(6.5 * len(plan.ratios), 8), squeeze=False, sharex=True)
    for col, ratio in enumerate(plan.ratios):
        for row, (column, what) in enumerate(((2, "fine-tune source"), (3, "pretraining source"))):
            ax = axes[row][col]
            for rec in records:
                cell = rec["cell"]
                if cell.ratio not in (None, ratio):
                    continue
                x, y = _mean_curve(rec["curves"], column)
                if cell.scoring is None:
                    ax.plot(x, y, color="black", lw=2.5, label="stock")
                elif cell.scoring == "random":
                    ax.plot(x, y, color="grey", lw=2, ls="--", label=cell.label)
                else:
                    ax.plot(
                        x, y, color=colors[cell.scoring], ls=styles.get(cell.depth, "-."), lw=1.2, label=cell.label
                    )
            ax.set_title(f"ratio {ratio}: held-out loss, {what}")
            ax.set_xlabel("training wall-clock (s, eval excluded)")
            ax.set_ylabel("loss over all tokens")
            ax.grid(alpha=0.3)
        axes[0][col].legend(fontsize=7, ncol=2)
    fig.suptitle("CGGR fine-tuning (seed means; router depth: 2 solid, middle dash-dot, -1 dotted)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- main --------------------------------------------------------------------------------------------------------
def load_data(plan: Plan) -> tuple[Any, dict]:
    code = code_texts(plan.code_mb)
    docs = doc_texts()
    if plan.smoke:
        docs = docs[:30]
    code_train, code_held = split(code, 20)
    doc_train, doc_held = split(docs, 10)
    # The tokenizer sees both sources (a sample of the code, all of the docs), like a general-purpose vocabulary
    sample = code[: max(1, len(code) // 3)] + docs
    tok = train_tokenizer(sample, plan.vocab)
    data = {
        "pt_train": shuffled(blocks_of(tok, code_train, plan.seq), 0),
        "pt_held": shuffled(blocks_of(tok, code_held, plan.seq), 1)[: plan.eval_blocks],
        "ft_train": _Blocks(shuffled(blocks_of(tok, doc_train, plan.seq), 2)[: plan.ft_blocks]),
        "ft_held": shuffled(blocks_of(tok, doc_held, plan.seq), 3)[: plan.eval_blocks],
    }
    return tok, data


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny CPU run (< 60 s)")
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--budget-s", type=float, default=None, help="stop starting fine-tune runs after this")
    parser.add_argument("--pretrain-s", type=float, default=None, help="pretraining time box")
    parser.add_argument("--pretrained", type=Path, default=None, help="reuse a state dict saved by an earlier run")
    parser.add_argument("--work", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "cggr_quality")
    parser.add_argument("--out", default=os.environ.get("BENCH_RESULTS", str(RESULTS)))
    args = parser.parse_args(argv)
    plan = SMOKE if args.smoke else FULL
    plan = replace(
        plan,
        seeds=args.seeds or plan.seeds,
        budget_s=args.budget_s or plan.budget_s,
        pt_seconds=args.pretrain_s or plan.pt_seconds,
    )
    if plan.smoke:
        device = "cpu"
        torch.set_num_threads(1)  # tiny matrices: threads only add synchronisation (and stall on a busy machine)
    elif torch.cuda.is_available():
        device = "cuda"
        torch.backends.cuda.matmul.allow_tf32 = True
    else:
        parser.error("the full study needs CUDA; use --smoke on CPU")
    args.work.mkdir(parents=True, exist_ok=True)

    _, data = load_data(plan)
    pt_tokens = data["pt_train"].numel()
    print(
        f"data: pretrain {pt_tokens / 1e6:.2f}M tokens, fine-tune {len(data['ft_train'])} blocks of {plan.seq}, "
        f"held-out {data['ft_held'].shape[0]} + {data['pt_held'].shape[0]} blocks "
        f"({time.perf_counter() - START:.0f} s)",
        flush=True,
    )
    if args.pretrained is not None:
        model = build_model(plan, device)
        model.load_state_dict(torch.load(args.pretrained, map_location=device))
        pt_curve = [(0, 0.0, heldout_loss(model, data["pt_held"], device))]
        pt_best = pt_curve[0]
    else:
        budget = f"{plan.pt_steps} steps" if plan.pt_steps else f"{plan.pt_seconds:.0f} s"
        print(f"pretraining for {budget}", flush=True)
        model, pt_curve, pt_best = pretrain(plan, data["pt_train"], data["pt_held"], device)
        torch.save(model.state_dict(), args.work / "pretrained.pt")
        print(f"saved {args.work / 'pretrained.pt'}", flush=True)
    base_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    data["ft0"] = heldout_loss(model, data["ft_held"], device)
    data["pt0"] = heldout_loss(model, data["pt_held"], device)
    params = sum(p.numel() for p in model.parameters())
    del model

    all_cells = cells(plan)
    steps = len(data["ft_train"]) // plan.ft_batch
    runs: dict[str, list[dict]] = {}
    total = len(all_cells) * plan.seeds
    t_ft = time.perf_counter()
    for seed in range(plan.seeds):  # seed-major: a time-out leaves every cell with the same number of seeds
        if seed and time.perf_counter() - START > plan.budget_s:
            print(f"over the {plan.budget_s:.0f} s budget: stopping after {seed} seed(s)", flush=True)
            break
        for cell in all_cells:
            result = finetune(plan, cell, seed, base_state, data, device, args.work)
            runs.setdefault(cell.label, []).append(result)
            done = sum(len(v) for v in runs.values())
            eta = (time.perf_counter() - t_ft) / done * (total - done)
            print(
                f"  [{done}/{total}] seed {seed} {cell.label:<22} ft {result['curve'][-1][2]:.3f} "
                f"pt {result['curve'][-1][3]:.3f}  {result['ms_per_step']:.1f} ms/step  kept {result['kept']:.2f}  "
                f"(eta {eta:.0f} s)",
                flush=True,
            )
    records, t_star = aggregate(plan, runs, all_cells)
    meta = {
        "params_m": params / 1e6,
        "pt_steps": pt_curve[-1][0],
        "pt_seconds": pt_curve[-1][1],
        "pt_tokens_m": pt_tokens / 1e6,
        "pt_curve": [(s, round(t), round(v, 3)) for s, t, v in pt_curve],
        "pt_best": (pt_best[0], round(pt_best[1]), round(pt_best[2], 3)),
        "ft_steps": steps,
        "cggr_warmup": max(1, round(plan.cggr_warmup_frac * steps)),
        "ft_start_loss": data["ft0"],
        "pt_start_loss": data["pt0"],
        "smoke": plan.smoke,
    }
    out = report(plan, records, t_star, meta, Path(args.out))
    print((out / "cggr_quality.md").read_text())
    print(f"wrote {out}/cggr_quality.{{json,md,png}} in {time.perf_counter() - START:.0f} s")
    return out


if __name__ == "__main__":
    main()
