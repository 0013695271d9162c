"""One launch for the compile-cache test: a tiny Llama Trainer step under compile_layers (inductor), then the
status and torch's cache counters as one JSON line. Run as a script, with TORCHINDUCTOR_CACHE_DIR set by the test."""

from __future__ import annotations

import json
import sys

import transformers
from torch._dynamo.utils import counters

import leantrain
from leantrain.cli.tiny import tiny_model
from testkit.batches import pad_right, random_rows
from testkit.optimizations import only


def main(out_dir: str) -> None:
    model = tiny_model("llama", vocab_size=256, hidden=64, layers=2).train()
    args = transformers.TrainingArguments(
        output_dir=out_dir, report_to=[], use_cpu=True, save_strategy="no", per_device_train_batch_size=2,
        max_steps=1, disable_tqdm=True,
    )  # fmt: skip
    rows = random_rows(4, (12,), 256)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows, data_collator=pad_right)
    report = leantrain.patch_trainer(trainer, **only("compile_layers"))
    trainer.train()
    status = report["compile_layers"].status.value
    print(json.dumps({"status": status, "inductor": counters["inductor"], "aot": counters["aot_autograd"]}))


if __name__ == "__main__":
    main(sys.argv[1])
