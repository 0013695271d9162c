"""The tiny MoE models (stacked or per-expert 4-bit experts) and their trainer, shared by the model-level moe4bit
tests and the DataParallel replica test.
(A helper module: a test module is never imported as one.)"""

from __future__ import annotations

import transformers

import leantrain  # noqa: E402
from leantrain.cli.tiny import tiny_model  # noqa: E402
from testkit.moe4bit_models import convert_model_to_linear4bit_experts, token_trainer  # noqa: E402


VOCAB, SEQ = 256, 16


def make_model(family: str, layout: str) -> transformers.PreTrainedModel:
    model = tiny_model(family, seed=0, hidden=128, layers=2, vocab_size=VOCAB)
    model.set_experts_implementation("eager")  # the stock per-expert loop
    if layout == "stacked":
        leantrain.quantize_experts_4bit(model)
    else:
        convert_model_to_linear4bit_experts(model)
    return model.train()


def make_trainer(model, tmp_path, steps: int = 2) -> transformers.Trainer:
    return token_trainer(model, tmp_path, steps, learning_rate=1e-3, vocab=VOCAB, seq=SEQ)
