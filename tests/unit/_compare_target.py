"""A training script that knows nothing of leantrain: the target of ``leantrain compare`` in
tests/unit/test_compare.py. A tiny llama trained by a plain ``transformers.Trainer`` on fixed random tokens, fp32.

``--differ`` makes the stock and leantrain runs train differently (a larger learning rate unless the kill switch is
on): their losses agree at step 1 (no update yet) and part from step 2, the forced loss difference of the tests.
"""

from __future__ import annotations

import argparse
import os


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--differ", action="store_true")
    parser.add_argument("--out", required=True, help="the Trainer's output_dir: compare must leave it unwritten")
    args = parser.parse_args()

    import torch
    from transformers import Trainer, TrainingArguments

    from leantrain.cli.tiny import tiny_model

    torch.set_num_threads(1)
    model = tiny_model("llama", vocab_size=128, hidden=32, layers=2).train()
    torch.manual_seed(0)
    rows = [{"input_ids": ids, "labels": ids.clone()} for ids in torch.randint(3, 128, (64, 16))]
    stock = os.environ.get("LEANTRAIN_DISABLE") == "1"
    config = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=2,
        report_to="none",
        use_cpu=True,
        save_strategy="steps",  # compare turns checkpoints off: nothing may be written
        save_steps=1,
        logging_steps=5,  # compare logs every step
        disable_tqdm=True,
        learning_rate=3e-3 if args.differ and not stock else 1e-3,
    )
    Trainer(model=model, args=config, train_dataset=rows).train()
    raise SystemExit("compare ends the process after train(): this line never runs")


if __name__ == "__main__":
    main()
