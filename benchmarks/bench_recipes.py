"""Whole training steps of real recipes, stock vs leantrain: what ``patch_trainer`` changes in a step, measured.

Random-init public shapes with their real vocab sizes (nothing downloaded); one GPU call per recipe, each under
8 minutes on an H100 including the model builds (a time budget skips what would not fit, recorded as "skipped"):

- ``grpo``: TRL ``GRPOTrainer``, Qwen2.5-0.5B and 1.5B shapes, 16 completions per step (2 prompts x 8 generations)
  x 256 completion tokens, beta 0.04 (reference model) and beta 0: stock vs ``patch_trainer(grpo_logps=True)``.
  Every step's completion token count and a hash of the completion token ids are recorded (same completions?).
  Fair pairs: a priming round (every variant runs all its steps once, discarded) warms each shape's per-length
  attention plans and kernel caches, then each pair runs stock first and then leantrain first (``--orders 2``);
  medians run over both orders' timed steps (per-order medians in the notes; the table's "timed" column says so).
  One 1.5B beta with its priming takes ~5-6 minutes: ``--shapes qwen2.5-1.5b --betas 0`` (and ``--betas 0.04``).
- ``grpo_lora``: LoRA GRPO at the Qwen2.5-7B shape (28 layers, hidden 3584, 28 q / 4 kv heads, intermediate 18944,
  vocab 152064, untied head), bf16 random init, PEFT LoRA r=16 on q/k/v/o/gate/up/down (LM head frozen), same
  batch and completions as ``grpo``, beta 0 (``--betas 0.04``: TRL's reference is the base model with the adapters
  disabled, no second model); a fresh seeded model per variant; primed, one order (both orders do not fit 8
  minutes at 7B; ``--orders 2 --budget-s 560`` asks for them). ``--layers N`` builds fewer layers.
- ``sft``: TRL ``SFTTrainer``, Qwen2.5-0.5B and 1.5B shapes, batch 8 x 2048, bf16, gradient checkpointing: stock
  vs CGGR (``cggr=True``, ratio 0.25 and 0.5, ``cggr_warmup_steps=0``).
- ``dense_sft``: Gemma-2-2B (eager attention, vocab 256000), Qwen2.5-1.5B and Llama-3.2-1B shapes, LoRA r=16 on
  every attention and MLP projection (head frozen), batch 4 x 2048, bf16, gradient checkpointing, AdamW, median of 8
  steps after 2 warm-up steps (the first step's time is in the table: compiles count). TRL ``SFTTrainer`` on its
  default loss path and a plain ``Trainer`` (the model's own loss over full logits; config ``... trainer logits``;
  with TRL <= 1.14 also ``SFTTrainer(loss_type="nll")``, ``... sft nll logits``). Variants: stock,
  ``patch_trainer(trainer)`` (the defaults; its report says what applied), ``patch_trainer(trainer,
  layer_kernels=True)``, regional ``torch.compile`` of the decoder layers (SFT default path only) and Liger-Kernel via
  ``use_liger_kernel=True`` (last in each group; its process-wide patch is undone after it). One shape per call:
  ``--shapes gemma-2-2b`` ~4 min, qwen2.5-1.5b and llama-3.2-1b ~2-3 min each on an H100.
- ``moe_qlora``: the gpt-oss-20b shape (24 layers, 32 experts, top-4, hidden 2880, vocab 201088), LoRA r=16 on the
  attention projections, experts frozen; batch 2 x 2048. Variants: leantrain's grouped 4-bit path on
  ``quantize_experts_4bit`` stacks and on per-expert ``bnb.nn.Linear4bit`` lists (community checkpoint layout),
  each against the same layout unpatched (transformers' dequantize-on-access stacks; the per-expert loop), and stock
  transformers with bf16 experts ("oom" when it does not fit). Built on the meta device and materialized one layer
  at a time on the GPU, its experts quantized as it appears (never all bf16 experts at once); build time recorded.
- ``moe_qlora_experts``: QLoRA with LoRA on attention AND experts at the Qwen3-30B-A3B shape (128 experts, top-8,
  hidden 2048, expert intermediate 768, 32 q / 4 kv heads of 128) built with 2 and 4 of its 48 layers
  (``--layers``), SFT batch 1 x 2048. Attention nf4 ``Linear4bit`` (double quantization, as BitsAndBytesConfig loads
  it), LoRA r=16 on q/k/v/o (``target_modules``) and on ``mlp.experts.gate_up_proj`` / ``down_proj`` (PEFT
  ``target_parameters``). Stock: bf16 3-D experts (transformers 5.23); leantrain: ``quantize_experts_4bit`` stacks
  + ``patch_trainer(moe4bit=True)``; the same stacks unpatched as a reference. A variant left without expert
  adapters (PEFT matched nothing) is "not measured", with the reason. The table projects the peak memory to the
  48-layer model from the two layer counts (slope per layer) next to a 24 GiB card.
- ``osft``: Llama-3.2-1B shape, SFT batch 4 x 2048, fp32 weights under bf16 autocast: dense full fine-tuning vs
  leantrain ``osft=True`` vs mini_trainer 0.9.0's OSFT model class and projections (leantrain's initial factors,
  no second SVD; run in the same HF Trainer, projections in the optimizer callbacks).

Per step after warm-up: total time (``on_step_begin`` -> ``on_step_end``, CUDA-synchronized) split into exclusive
parts: ``generation`` (``_generate``), ``logps`` (old/reference log-probs: ``_get_per_token_logps_and_entropies``
without grad), ``prepare`` (the rest of ``_prepare_inputs``: rewards, advantages), ``forward`` (``compute_loss``),
``backward`` (the rest of ``training_step``), ``clip`` (``_clip_grad_norm``), ``optimizer``
(``on_pre_optimizer_step`` -> ``on_optimizer_step``, OSFT projections included) and ``other`` (scheduler,
zero_grad, callbacks); tokens/s; peak memory above what was allocated before the variant was built; per-step losses.

    python benchmarks/bench_recipes.py --recipe grpo        # one recipe (CUDA); also grpo_lora, sft, dense_sft,
                                                            # moe_qlora, moe_qlora_experts, osft
    python benchmarks/bench_recipes.py                      # --recipe all: the seven in turn (~50 min)
    python benchmarks/bench_recipes.py --smoke              # every recipe on tiny shapes on CPU (~1 min)
    python benchmarks/bench_recipes.py --smoke --device cuda    # the same on the GPU: its CUDA paths, in seconds
    python benchmarks/bench_recipes.py --merge a.json b.json    # rebuild recipes.{json,md,png} from several runs
    BENCH_RECIPE=grpo BENCH_RECIPE_SHAPES=qwen2.5-0.5b bash benchmarks/gpu_run.sh recipes   # the same, by env vars

``--shapes`` (grpo / sft / dense_sft), ``--only`` (variant-name substrings), ``--budget-s``, ``--orders`` (grpo,
grpo_lora) and ``--layers`` (grpo_lora, moe_qlora_experts) select less or other; their environment twins are
BENCH_RECIPE_SHAPES, BENCH_RECIPE_ONLY, BENCH_RECIPE_BUDGET_S, BENCH_RECIPE_ORDERS and BENCH_RECIPE_LAYERS.

Writes ``recipes.json`` (rows of every recipe run so far: the rows already in ``$BENCH_RESULTS/recipes.json``, else
in ``benchmarks/results/recipes.json``, with the (recipe, config) pairs just run replaced), ``recipes.md`` and
``recipes.png`` (step time per variant, split stacked, one panel per recipe) into ``$BENCH_RESULTS`` or
``benchmarks/results/``.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from _harness import RESULTS, Row, previous_rows, read_rows  # noqa: E402
from recipes import dense_sft, grpo, moe_experts, moe_qlora, osft, sft  # noqa: E402
from recipes.report import markdown, merge, to_rows, write_all  # noqa: E402
from recipes.runner import NAME, RECIPES, Budget, log  # noqa: E402
from recipes.settings import FULL, SMOKE, Settings  # noqa: E402


RECIPE_FNS = {
    "grpo": grpo.recipe_grpo,
    "grpo_lora": grpo.recipe_grpo_lora,
    "sft": sft.recipe_sft,
    "dense_sft": dense_sft.recipe_dense_sft,
    "moe_qlora": moe_qlora.recipe_moe_qlora,
    "moe_qlora_experts": moe_experts.recipe_moe_qlora_experts,
    "osft": osft.recipe_osft,
}
assert tuple(RECIPE_FNS) == RECIPES


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(",") if x.strip())


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x.strip())


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    # Defaults from the environment too, so `BENCH_RECIPE=grpo bash benchmarks/gpu_run.sh recipes` picks one.
    env = os.environ.get
    parser.add_argument("--recipe", default=env("BENCH_RECIPE", "all"), choices=(*RECIPES, "all"))
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU, every recipe (~1 min)")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), help="with --smoke: run the tiny shapes here (cuda: check the CUDA paths)"
    )
    parser.add_argument(
        "--shapes", default=env("BENCH_RECIPE_SHAPES"), help="comma-separated grpo / sft / dense_sft shapes"
    )
    parser.add_argument(
        "--only",
        default=env("BENCH_RECIPE_ONLY"),
        help="run only variants whose name has one of these comma-separated substrings",
    )
    parser.add_argument(
        "--budget-s",
        type=float,
        default=env("BENCH_RECIPE_BUDGET_S"),
        help="per-recipe time budget (default 450 s on CUDA)",
    )
    parser.add_argument(
        "--betas", type=_floats, default=None, help="grpo / grpo_lora: comma-separated betas (default 0.04,0 / 0)"
    )
    parser.add_argument(
        "--reverse", action="store_true", help="grpo, grpo_lora: the first order leantrain first (the second: stock)"
    )
    parser.add_argument(
        "--orders",
        type=int,
        choices=(1, 2),
        default=env("BENCH_RECIPE_ORDERS") and int(env("BENCH_RECIPE_ORDERS")),
        help="grpo, grpo_lora: 2 times each pair in both orders, medians over both (grpo default); 1: one order "
        "(grpo_lora default)",
    )
    parser.add_argument(
        "--layers",
        type=_ints,
        default=env("BENCH_RECIPE_LAYERS") and _ints(env("BENCH_RECIPE_LAYERS")),
        help="grpo_lora: decoder layers to build (default all 28); moe_qlora_experts: comma-separated counts "
        "(default 2,4; two give the per-layer memory)",
    )
    parser.add_argument("--merge", nargs="+", type=Path, help="only merge these recipes.json files and redraw")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    default_out = Path(tempfile.gettempdir()) / "leantrain_recipes_smoke" if args.smoke else RESULTS
    out_dir = Path(os.environ.get("BENCH_RESULTS", default_out))
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.merge:
        rows: list[Row] = []
        for path in args.merge:
            rows = merge(rows, read_rows(path))
        write_all(rows, out_dir)
        return 0
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("the recipes need CUDA; use --smoke on CPU")
    s = SMOKE if args.smoke else FULL
    if args.device is not None:
        if not args.smoke:
            raise SystemExit("--device goes with --smoke (the full recipes run on CUDA)")
        if args.device == "cuda" and not torch.cuda.is_available():
            raise SystemExit("--device cuda: this machine has no CUDA device")
        s = Settings(**{**s.__dict__, "device": args.device})
    if args.budget_s is not None:
        s = Settings(**{**s.__dict__, "budget_s": args.budget_s})
    if not s.cuda:
        torch.set_num_threads(1)  # tiny CPU shapes: a second thread only adds contention (and spin-waits)
    _quiet()
    recipes = RECIPES if args.recipe == "all" else (args.recipe,)
    records: list[dict] = []
    for recipe in recipes:
        t0 = time.perf_counter()
        log(f"=== {recipe}")
        records += RECIPE_FNS[recipe](s, Budget(s.budget_s), args)
        log(f"=== {recipe} done in {time.perf_counter() - t0:.0f} s")
    new = [row for rec in records for row in to_rows(rec)]
    rows = merge(previous_rows(NAME, out_dir, args.smoke), new)
    write_all(rows, out_dir)
    print(markdown([r for r in rows if r.mode in recipes]), flush=True)
    failed = [r for r in records if r["status"] == "failed" and r["kind"] in ("stock", "leantrain")]
    return 1 if failed else 0


def _quiet() -> None:
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()


if __name__ == "__main__":
    raise SystemExit(main())
