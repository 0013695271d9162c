"""A training script that knows nothing of leantrain: the target of ``leantrain run`` in tests/unit/test_run.py and
tests/distributed/test_run_torchrun.py (as a file, as ``-m tests.unit._run_target`` and as a faked console script).

It trains a tiny llama with a plain ``transformers.Trainer`` for a few steps, optionally saves it, and writes what a
test needs to ``<out>/result_rank<R>.json``: the report the trainer carries, its log_history, what it saw in argv.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--exit-code", type=int, default=0)
    parser.add_argument("--cggr", action="store_true", help="the target's own flag, same name as leantrain's")
    parser.add_argument("--no-train", action="store_true", help="build the trainer, then stop before train()")
    args = parser.parse_args(argv)

    import torch
    from transformers import Trainer, TrainingArguments

    from leantrain.cli.tiny import tiny_model

    out = Path(args.out)
    model = tiny_model("llama", vocab_size=128, hidden=64, layers=args.layers).train()
    torch.manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(3, 128, (8, 12))]
    config = TrainingArguments(
        output_dir=str(out / "model"),
        max_steps=args.steps,
        per_device_train_batch_size=2,
        report_to="none",
        use_cpu=True,
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        learning_rate=1e-3,
        ddp_timeout=180,  # a rank that dies must not leave the other waiting for 30 minutes
    )
    trainer = Trainer(model=model, args=config, train_dataset=rows)
    if args.no_train:
        return 0
    trainer.train()
    if args.save:
        trainer.save_model()
    report = trainer.__dict__.get("leantrain_report")
    result = {
        "argv": sys.argv[1:],
        "own_cggr_flag": args.cggr,
        "world": trainer.args.world_size,
        "report": None if report is None else report.to_dict(),
        "log_history": trainer.state.log_history,
        "global_step": trainer.state.global_step,
        "optimizer": trainer.optimizer is not None,
    }
    rank = os.environ.get("RANK", "0")
    (out / f"result_rank{rank}.json").write_text(json.dumps(result, indent=1))
    # A distributed script ends its process group before exit (accelerate's end_training): left to the interpreter's
    # teardown, a gloo rank's threads have aborted it ("terminate called without an active exception") after it had
    # trained and written everything. A barrier first: every rank leaves together.
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
