"""COMPATIBILITY.md from the CI run itself: each tested version set patches a tiny CPU trainer of each kind per
optimization and records what leantrain's report says; the markdown is rendered from those records.

    python .ci/compat_table.py record OUT.json              # in one venv: patch every scenario, write the outcomes
    python .ci/compat_table.py render A.json ... [--check F] # markdown to stdout, or fail if F differs from it
    python .ci/compat_table.py engines --write COMPATIBILITY.md  # its engines section from the newest GPU results

Each optimization is requested explicitly (``True``; the others off), so the table shows whether the installed
versions can run it and, if not, the probe's reason. Auto mode declines further where an optimization would not
pay on the device (README, "Using each optimization"); the parity tests of the same CI run check that what applies
here matches the stock path.

The optimizations are the option table's (``leantrain.config.OPTIMIZATIONS``, in its order), each tried on a tiny
trainer of every kind it declares (``Optimization.trainer_kinds``): a new one appears here with no edit. Only an
optimization that needs a particular model (moe4bit: 4-bit MoE experts) names its own scenarios.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


ROOT = Path(__file__).resolve().parents[1]


def _option_table() -> Any:
    """leantrain/config.py loaded on its own (standard library only): ``render`` runs under a bare python3, where
    importing the package (torch, transformers) is not possible."""
    spec = importlib.util.spec_from_file_location("_leantrain_config", ROOT / "src" / "leantrain" / "config.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


OPTIMIZATIONS: tuple[str, ...] = _option_table().OPTIMIZATIONS
PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes")
VOCAB = 256


def _rows(n: int = 8, length: int = 16) -> list[dict[str, Any]]:
    import torch

    ids = torch.randint(3, VOCAB, (n, length), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": row, "labels": row.clone()} for row in ids]


def _args(cls: Callable[..., Any], out: str, **extra: Any) -> Any:
    common = dict(output_dir=out, max_steps=1, per_device_train_batch_size=4, report_to="none", use_cpu=True)
    return cls(**common, save_strategy="no", **extra)


def plain_trainer(model: Any, out: str, **extra: Any) -> Any:
    import transformers

    args = _args(transformers.TrainingArguments, out, **extra)
    return transformers.Trainer(model=model, args=args, train_dataset=_rows())


def llama() -> Any:
    from leantrain.cli.tiny import tiny_model

    return tiny_model("llama", vocab_size=VOCAB, layers=4).train()


def sft_trainer(out: str, **extra: Any) -> Any:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from leantrain.cli.tiny import corpus_texts, tiny_model, train_tokenizer

    tok = train_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok), layers=4).train()
    data = Dataset.from_dict({"text": corpus_texts()[:8]})
    args = _args(SFTConfig, out, max_length=32, **extra)
    return SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)


def rl_trainer(kind: str, out: str, **extra: Any) -> Any:
    import trl
    from datasets import Dataset

    from leantrain.cli.tiny import tiny_model, train_tokenizer

    tok = train_tokenizer()
    model = tiny_model("llama", vocab_size=len(tok), layers=2)
    model.save_pretrained(f"{out}/model")  # the reference model (beta > 0) is loaded from the policy's path
    model.config._name_or_path = f"{out}/model"
    config_cls, trainer_cls = getattr(trl, f"{kind}Config"), getattr(trl, f"{kind}Trainer")
    args = _args(config_cls, out, num_generations=4, max_completion_length=8, bf16=False, **extra)
    return trainer_cls(
        model=model,
        reward_funcs=lambda completions, **kw: [float(len(c)) for c in completions],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a b c"] * 8}),
        processing_class=tok,
    )


def moe_trainer(family: str, layout: str, out: str) -> Any:
    """A tiny MoE with 4-bit experts: ``stacked`` = stock 3-D experts through quantize_experts_4bit, ``linear4bit``
    = per-expert bitsandbytes lists (the community gpt-oss layout)."""
    import leantrain

    sys.path.insert(0, str(ROOT))  # testkit/: the scaffolding tests and benchmarks share
    from leantrain.cli.tiny import tiny_model
    from testkit.moe4bit_models import convert_model_to_linear4bit_experts

    model = tiny_model(family, vocab_size=VOCAB, hidden=128, layers=2)
    if layout in ("stacked", "stacked+lora"):
        leantrain.quantize_experts_4bit(model)
    elif layout == "bnb":  # what BitsAndBytesConfig(load_in_4bit=True) makes: every nn.Linear but router and head
        from testkit.moe4bit_models import load_in_4bit_like

        load_in_4bit_like(model, skip=("gate", "router", "lm_head"))
    else:
        convert_model_to_linear4bit_experts(model)
    if layout == "stacked+lora":  # LoRA on attention and on the 4-bit expert stacks (PEFT target_parameters)
        from peft import LoraConfig, get_peft_model

        targets = leantrain.expert_lora_targets(model)
        model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj"], target_parameters=targets))
    return plain_trainer(model.train(), out)


# The tiny trainers of each trainer kind (leantrain.optimization.TRAINER_KINDS): (label, builder).
KIND_SCENARIOS: dict[str, tuple[tuple[str, Callable[[str], Any]], ...]] = {
    "sft": (("SFTTrainer", sft_trainer),),
    "trainer": (("Trainer", lambda out: plain_trainer(llama(), out)),),
    "grpo": (
        ("GRPOTrainer", lambda out: rl_trainer("GRPO", out)),
        ("RLOOTrainer", lambda out: rl_trainer("RLOO", out)),
    ),
}
CHECKPOINTED = {"gradient_checkpointing": True}
# Optimizations whose probe needs a model with what they optimize: their own scenarios instead of the kinds'.
MODEL_SCENARIOS: dict[str, tuple[tuple[str, Callable[[str], Any]], ...]] = {
    "offload_checkpoints": (
        ("SFTTrainer, gradient_checkpointing=True", lambda o: sft_trainer(o, **CHECKPOINTED)),
        ("Trainer, gradient_checkpointing=True", lambda o: plain_trainer(llama(), o, **CHECKPOINTED)),
        ("GRPOTrainer, gradient_checkpointing=True", lambda o: rl_trainer("GRPO", o, **CHECKPOINTED)),
        ("Trainer without checkpointing", lambda o: plain_trainer(llama(), o)),
    ),
    "moe4bit": (
        ("Trainer, Qwen3-MoE 3-D experts (quantize_experts_4bit)", lambda o: moe_trainer("qwen3_moe", "stacked", o)),
        ("Trainer, gpt-oss 3-D experts (quantize_experts_4bit)", lambda o: moe_trainer("gpt_oss", "stacked", o)),
        ("Trainer, gpt-oss Linear4bit expert lists", lambda o: moe_trainer("gpt_oss", "linear4bit", o)),
        (
            "Trainer, Qwen3-MoE loaded as BitsAndBytesConfig(load_in_4bit) would",
            lambda o: moe_trainer("qwen3_moe", "bnb", o),
        ),
        (
            "Trainer, Qwen3-MoE 4-bit 3-D experts + LoRA on them (target_parameters)",
            lambda o: moe_trainer("qwen3_moe", "stacked+lora", o),
        ),
    ),
}


def scenarios() -> list[tuple[str, str, Callable[[str], Any]]]:
    """(optimization, scenario label, trainer builder) for every optimization of the option table, in its order."""
    from leantrain.optimization import TRAINER_KINDS, registry

    rows = []
    for name, opt in registry().items():
        own = MODEL_SCENARIOS.get(name)
        kinds = [kind for kind in TRAINER_KINDS if kind in opt.trainer_kinds]
        chosen = own if own is not None else [s for kind in kinds for s in KIND_SCENARIOS[kind]]
        rows += [(name, label, build) for label, build in chosen]
    return rows


def _one_line(text: object) -> str:
    """One markdown-safe line; measured floats (reconstruction errors, ...) and host memory figures masked so that
    every CPU writes the same table."""
    line = " ".join(str(text).split()).replace("|", "\\|")
    line = re.sub(r"\b\d\.\d+e[-+]?\d+\b", "<measured>", line)
    # a budget read from the host's free memory differs between CI machines
    return re.sub(r"bounded at [^;()]+\(half of the [^)]+\)", "bounded at half of the host memory available", line)


def run_scenario(name: str, build: Callable[[str], Any]) -> dict[str, str]:
    """Build the trainer, request ``name`` alone, and record applies / declines with the reason."""
    import torch

    import leantrain

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as out, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            trainer = build(out)
        except Exception as error:  # the model or trainer cannot even be built with these versions
            return {"status": "declines", "why": f"setup fails: {type(error).__name__}: {_one_line(error)}"}
        toggles = {o: (o == name) for o in OPTIMIZATIONS}
        try:
            report = leantrain.patch_trainer(trainer, environ={}, **toggles)
        except leantrain.NotReadyError as error:
            return {"status": "declines", "why": _one_line(error).split(": ", 1)[-1]}
        outcome = report[name]
        leantrain.unpatch_trainer(trainer)
    return {"status": outcome.status.value, "why": _one_line(outcome.detail or "; ".join(outcome.reasons))}


def record(path: str) -> int:
    from importlib import metadata

    sys.path.insert(0, str(ROOT / "src"))
    from leantrain._compat import current_set

    tested = current_set()
    versions = {}
    for package in PACKAGES:
        try:
            versions[package] = metadata.version(package).split("+")[0]
        except metadata.PackageNotFoundError:
            versions[package] = "-"
    rows = []
    for name, label, build in scenarios():
        result = run_scenario(name, build)
        print(f"{name:<11} {label:<58} {result['status']}: {result['why'][:140]}", flush=True)
        rows.append({"optimization": name, "scenario": label, **result})
    data = {"set": tested.name if tested else "untested", "label": tested.label if tested else "", "rows": rows}
    data["versions"] = versions
    Path(path).write_text(json.dumps(data, indent=1) + "\n")
    return 0


def render(records: list[dict[str, Any]]) -> str:
    lines = [
        "# Compatibility",
        "",
        "<!-- Generated by .ci/compat_table.py from the CI run (.ci/run); do not edit by hand. -->",
        "",
        "Every tested version set patches a tiny CPU trainer per optimization, requesting that optimization alone",
        "(`True`), and records leantrain's report: **applies** (the path it takes) or **declines** (the probe's",
        "reason). In auto mode an optimization also declines where it would not pay on the device (see the README).",
        "The same CI run runs each optimization's CPU parity tests against every set.",
        "",
        "| set | " + " | ".join(PACKAGES) + " |",
        "| --- | " + " | ".join("---" for _ in PACKAGES) + " |",
    ]
    for rec in records:
        lines.append(f"| `{rec['set']}` | " + " | ".join(rec["versions"][p] for p in PACKAGES) + " |")
    for name in OPTIMIZATIONS:
        lines += ["", f"## `{name}`", "", "| set | trainer | result |", "| --- | --- | --- |"]
        for rec in records:
            for row in rec["rows"]:
                if row["optimization"] == name:
                    lines.append(f"| `{rec['set']}` | {row['scenario']} | **{row['status']}**: {row['why']} |")
    return "\n".join(lines + engines()) + "\n"


# The engines the distributed tests run (tests/distributed, 2 CPU processes over gloo, latest set, in CI) and what
# has run on GPUs; measured distances in benchmarks/results/distributed/cpu_engines.md. The "on GPUs" column comes
# from the newest GPU table benchmarks/dist_table.py wrote (benchmarks/results/distributed/dist_*.json) where one
# exists, else from the runs listed here by hand (GPU_BY_HAND).
ENGINE_ROWS = [  # (engine key in the GPU table, engine, run in CI)
    ("ddp", "DDP", "CGGR, fused log-probs, OSFT, moe4bit, compiled generation, offloaded checkpoints"),
    (
        "fsdp2",
        "FSDP2",
        "CGGR, fused log-probs, OSFT (both V layouts), moe4bit (plan per call), offloaded checkpoints",
    ),
    ("zero2", "DeepSpeed ZeRO-2", "CGGR, fused log-probs (OSFT declines), `examples/train_sft.py`"),
    (
        "zero3",
        "DeepSpeed ZeRO-3",
        "CGGR, fused log-probs (partitioned head gathered; OSFT and moe4bit decline), `examples/train_sft.py`",
    ),
]
GPU_BY_HAND = {
    "ddp": "2x H200 (NCCL) on 2026-11-24: SFT+CGGR, SFT+OSFT, GRPO",
    "fsdp2": "2x H200 (NCCL) on 2026-11-24",
    "zero2": "2x H200 on 2026-11-24: SFT+CGGR",
    "zero3": "2x H200 on 2026-11-24: GRPO",
}
DATA_PARALLEL_ROW = (
    "| `nn.DataParallel` (one process, several GPUs) | CGGR and moe4bit decline (probe tests with n_gpu=2) | "
    "`tests/gpu/test_data_parallel.py` on 2x NVIDIA H200, 2026-11-27: 5 passed |"
)
DIST_RESULTS = ROOT / "benchmarks" / "results" / "distributed"


def _gpu_table() -> dict[str, Any] | None:
    """The newest dist_*.json measured on a GPU (by its date, then name), or None."""
    tables = []
    for path in sorted(DIST_RESULTS.glob("dist_*.json")):
        data = json.loads(path.read_text())
        if str(data["meta"].get("device") or "cpu").lower() != "cpu":
            tables.append((str(data["meta"]["date"]), path.name, data))
    return max(tables)[2] if tables else None


def _gpu_cell(data: dict[str, Any], engine: str) -> str:
    """``<device> x<n> on <date>: recipe (applied; declined: name), ...`` for the leantrain runs of one engine."""
    runs = []
    for row in data["rows"]:
        if row["engine"] != engine or row["variant"] != "leantrain":
            continue
        if not row.get("ranks_reported"):
            runs.append(f"{row['recipe']} (did not run)")
            continue
        declined = [
            d.split(":")[0] for d in row.get("declined", []) if "does not apply" not in d and "no MoE" not in d
        ]
        what = ", ".join(row.get("applied") or ["nothing applied"])
        what += f"; declined: {', '.join(declined)}" if declined else ""
        what += f"; failed: {', '.join(f.split(':')[0] for f in row['failed'])}" if row.get("failed") else ""
        runs.append(f"{row['recipe']} ({what})")
    if not runs:
        return "not run"
    meta = data["meta"]
    return f"{meta['world_size']}x {meta['device']} on {str(meta['date'])[:10]}: " + ", ".join(runs)


def engines() -> list[str]:
    data = _gpu_table()
    lines = [
        "",
        "## Distributed engines",
        "",
        "| engine | run in CI (2 CPU processes, gloo, vs one process on the same global batch) | on GPUs |",
        "| --- | --- | --- |",
    ]
    for key, name, ci in ENGINE_ROWS:
        lines.append(f"| {name} | {ci} | {_gpu_cell(data, key) if data else GPU_BY_HAND[key]} |")
    return lines + [DATA_PARALLEL_ROW]


def write_engines(page: Path) -> int:
    """Replace the Distributed engines section (the page's last) with what ``engines()`` renders now: after new
    two-GPU results are committed, without re-running the version matrix."""
    text = page.read_text()
    marker = "\n## Distributed engines\n"
    if marker not in text:
        print(f"{page} has no '## Distributed engines' section", file=sys.stderr)
        return 1
    page.write_text(text[: text.index(marker)] + "\n".join(engines()) + "\n")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "record":
        return record(argv[1])
    if len(argv) == 3 and argv[:2] == ["engines", "--write"]:
        return write_engines(Path(argv[2]))
    if argv and argv[0] == "render":
        check = None
        if "--check" in argv:
            check = Path(argv[argv.index("--check") + 1])
            argv = argv[: argv.index("--check")]
        text = render([json.loads(Path(p).read_text()) for p in argv[1:]])
        if check is None:
            sys.stdout.write(text)
            return 0
        if not check.exists() or check.read_text() != text:
            sys.stdout.write(text)
            print(
                f"\n{check} differs from what this run generated (above): the tested versions or an outcome "
                f"changed. Update it with: bash .ci/matrix.sh --write",
                file=sys.stderr,
            )
            return 1
        print(f"{check} matches this run")
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
