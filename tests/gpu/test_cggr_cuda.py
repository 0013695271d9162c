"""CGGR on CUDA, where it saves work: TRL's SFTTrainer with its fused LM head, which on CUDA scores only the rows
whose label is not -100 (``trl.trainer.utils.add_fused_lm_head``, ``compact`` on Triton devices), on a model whose
LM head is ~2/3 of the per-token matmul work.

- ratio 1.0 and ratio 0.999 (whole router machinery, every label kept) are bitwise the stock run: per-step losses,
  grad norms, gradients and final parameters over three optimizer steps;
- ratio 0.5 is bitwise the stock run on the labels the router chose, replayed through the dataset (the same trainer
  loop, optimizer, loss normalizer): fp32 and bf16 autocast, gradient accumulation 2, the torch scoring path, PEFT
  LoRA, gradient checkpointing;
- gradient accumulation 2 equals one big batch (the window's kept count is the loss normalizer);
- the in-forward router picks the labels that scoring the full model's ``hidden_states[N]`` picks.

Bitwise holds because both sides run the same kernels on the same shapes (``deterministic`` fixture); see
``_trainer_helpers`` for the CPU development mode.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator

import pytest
import torch
from _trainer_helpers import (
    HIDDEN,
    LAYERS,
    VOCAB,
    assert_same,
    deterministic_algorithms,
    grads,
    log_values,
    params,
    rel,
    select_device,
    sft_rows,
    sft_trainer,
    unit_roundoff,
)
from transformers import TrainerCallback

import leantrain
from leantrain.cli.tiny import tiny_model
from testkit.optimizations import others_off


OFF = others_off("cggr")
ROUTER_LAYERS = 2


@pytest.fixture
def device(request: pytest.FixtureRequest) -> torch.device:
    return select_device(request)


@pytest.fixture
def deterministic() -> Iterator[None]:
    with deterministic_algorithms():
        yield


def model_for(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return tiny_model("llama", vocab_size=VOCAB, hidden=HIDDEN, layers=LAYERS, dtype=dtype).train()


def patch(trainer, ratio: float, **opts) -> None:
    report = leantrain.patch_trainer(
        trainer, cggr=True, cggr_min_tokens_ratio=ratio, cggr_warmup_steps=0, cggr_router_layers=ROUTER_LAYERS,
        **OFF, **opts,
    )  # fmt: skip
    assert report["cggr"].status.value == "applied", report


def assert_auto_path(trainer, on: torch.device) -> None:
    """The configuration is one where CGGR saves LM-head work: on CUDA the fused head skips masked rows."""
    from leantrain.cggr import AUTO_MIN_HEAD_SHARE, head_share, loss_path
    from leantrain.models import decoder_parts

    assert head_share(trainer.model.config) >= AUTO_MIN_HEAD_SHARE
    description, _, saves = loss_path(trainer, "sft", decoder_parts(trainer.model))
    assert saves == (on.type == "cuda"), description


class Recorder(TrainerCallback):
    """Gradients at every optimizer step (after clipping, before the step) and every training forward's batch."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []
        self.batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.model = model
        self.handle = model.register_forward_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs, output) -> None:
        # After the forward: CGGR has masked the labels it hands to the model (in place, during the forward).
        if module.training and "labels" in kwargs:
            self.batches.append(tuple(kwargs[k].detach().clone() for k in ("input_ids", "attention_mask", "labels")))

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        self.grads.append(grads(self.model))


def run(trainer) -> Recorder:
    recorder = Recorder(trainer.model)
    trainer.add_callback(recorder)
    trainer.train()
    recorder.handle.remove()
    return recorder


def assert_runs_equal(patched, stock, rec_p: Recorder, rec_s: Recorder) -> None:
    """Bitwise: per-step losses and grad norms, gradients at every step, final parameters."""
    assert log_values(patched, "loss") == log_values(stock, "loss") and log_values(stock, "loss")
    assert log_values(patched, "grad_norm") == log_values(stock, "grad_norm")
    assert len(rec_p.grads) == len(rec_s.grads) == patched.state.global_step > 0
    for step, (a, b) in enumerate(zip(rec_p.grads, rec_s.grads)):
        assert_same(a, b, f"step {step} grad")
    assert_same(params(patched.model), params(stock.model), "final param")


def kept_labels_by_sequence(recorder: Recorder) -> dict[tuple[int, ...], list[int]]:
    """Sequence (its token ids) -> the labels the patched model was given for it."""
    chosen: dict[tuple[int, ...], list[int]] = {}
    for input_ids, attention_mask, labels in recorder.batches:
        for row in range(input_ids.shape[0]):
            n = int(attention_mask[row].sum())
            key = tuple(input_ids[row, :n].tolist())
            assert key not in chosen, "a sequence was trained twice: the replay would be ambiguous"
            chosen[key] = labels[row, :n].tolist()
    return chosen


def check_selection(rows: list[dict], chosen: dict, ratio: float) -> int:
    """Every chosen row keeps ceil(ratio * n) of its n valid labels (label 0 is never a causal target), never a
    -100 one, and never changes a token id. Returns the number of labels dropped."""
    by_key = {tuple(r["input_ids"]): r["labels"] for r in rows}
    dropped = 0
    for key, labels in chosen.items():
        original = by_key[key]
        valid = [t != -100 for t in original[1:]]
        kept = [t != -100 for t in labels[1:]]
        assert sum(kept) == math.ceil(ratio * sum(valid)), (sum(kept), sum(valid))
        assert all(v or not k for v, k in zip(valid, kept)), "a -100 label was kept"
        assert all(a == b for a, b, k in zip(original[1:], labels[1:], kept) if k)
        assert labels[0] == original[0]
        dropped += sum(valid) - sum(kept)
    return dropped


def replay_rows(rows: list[dict], chosen: dict) -> list[dict]:
    """The same dataset with the labels the router chose, masked by hand."""
    out = []
    for row in rows:
        labels = chosen.get(tuple(row["input_ids"]), row["labels"])
        out.append({"input_ids": row["input_ids"], "labels": list(labels)})
    return out


# ---- ratio 1.0 and 0.999: the stock run, bitwise ---------------------------------------------------------------


@pytest.mark.parametrize("ratio", [1.0, 0.999])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_ratio_one_is_stock_bitwise(ratio, precision, device, deterministic, tmp_path):
    """1.0 takes the stock path; 0.999 runs the router, the selection and the recount, and keeps every label of
    these rows (ceil(0.999 n) = n for n < 1000)."""
    rows = sft_rows()
    bf16 = precision == "bf16"  # bf16 autocast over fp32 weights, through accelerate's mixed precision
    model = model_for()
    stock = sft_trainer(copy.deepcopy(model), tmp_path / "s", device, rows, bf16=bf16)
    patched = sft_trainer(model, tmp_path / "p", device, rows, bf16=bf16)
    patch(patched, ratio)
    assert_auto_path(patched, device)
    rec_p, rec_s = run(patched), run(stock)
    assert_runs_equal(patched, stock, rec_p, rec_s)
    assert log_values(patched, "cggr/kept_fraction") == [1.0] * 3
    scored = [ms > 0 for ms in log_values(patched, "cggr/score_ms")]
    assert scored == [ratio < 1.0] * 3  # the router ran (0.999) or did not (1.0)


# ---- ratio 0.5: the stock run on the labels the router chose --------------------------------------------------

CASES = {
    "fp32": {},
    "bf16": {"bf16": True},
    "fp32-ga2": {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
    "bf16-ga2": {"bf16": True, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2},
    "fp32-margin": {"scoring": "margin"},  # torch scoring path (chunks through the head module)
    "fp32-lora": {"lora": True},
    "bf16-lora": {"bf16": True, "lora": True},
    "fp32-gc": {"activation_checkpointing": True, "activation_checkpointing_kwargs": {"use_reentrant": False}},
    "bf16-gc": {"bf16": True, "activation_checkpointing": True},  # transformers' default (non-reentrant)
    "fp32-lora-gc": {
        "lora": True,
        "activation_checkpointing": True,
        "activation_checkpointing_kwargs": {"use_reentrant": True},
    },
}


def lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model

    # init_lora_weights=False: B is random too, so the adapters change the forward from the first step
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    return get_peft_model(model, config)


@pytest.mark.parametrize("case", list(CASES))
def test_ratio_half_is_stock_on_the_chosen_labels(case, device, deterministic, tmp_path):
    args = dict(CASES[case])
    use_lora, scoring = args.pop("lora", False), args.pop("scoring", "entropy")
    rows = sft_rows()
    model = model_for()
    if use_lora:
        model = lora(model)
    stock_model = copy.deepcopy(model)
    patched = sft_trainer(model, tmp_path / "p", device, rows, **args)
    patch(patched, 0.5, cggr_scoring=scoring)
    assert_auto_path(patched, device)
    rec_p = run(patched)

    chosen = kept_labels_by_sequence(rec_p)
    assert len(chosen) == 12  # 3 optimizer steps x 4 sequences
    assert check_selection(rows, chosen, 0.5) > 100  # about half of ~400 labels dropped: the test can fail
    stock = sft_trainer(stock_model, tmp_path / "s", device, replay_rows(rows, chosen), **args)
    rec_s = run(stock)
    assert_runs_equal(patched, stock, rec_p, rec_s)
    # TRL's token metrics cover the kept tokens on both sides
    assert log_values(patched, "entropy") == log_values(stock, "entropy")
    fractions = log_values(patched, "cggr/kept_fraction")
    assert all(0.5 <= f < 0.55 for f in fractions), fractions  # ceil(n/2) of n >= 10 labels per row


# ---- gradient accumulation: the window's kept count is the normalizer -------------------------------------------


def window(trainer, batches: list[dict]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One accumulation window through the trainer's own counting and training_step."""
    samples, count = trainer.get_batch_samples(iter(batches), len(batches), trainer.args.device)
    losses = [trainer.training_step(trainer.model, b, count) for b in samples]
    return losses, count


def collate(trainer, rows: list[dict]) -> dict[str, torch.Tensor]:
    return trainer.data_collator([dict(r) for r in rows])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_grad_accumulation_two_equals_one_big_batch(dtype, device, deterministic, tmp_path):
    """CGGR under GA=2 (2 rows per micro-batch) vs one batch of the 4 rows with the same kept labels.

    Bitwise part: CGGR with GA=2 is stock GA=2 on the chosen labels (same shapes). Tolerance part: stock GA=2 vs one
    big batch, which differ only by summation order and the batch shapes of the GEMMs; a wrong normalizer (all
    labels instead of the kept ones, or per micro-batch) would be off by ~2x.
    """
    rows = sft_rows()[:4]
    model = model_for(dtype)
    big = sft_trainer(copy.deepcopy(model), tmp_path / "big", device, rows)
    stock_ga = sft_trainer(copy.deepcopy(model), tmp_path / "sga", device, rows, gradient_accumulation_steps=2)
    patched = sft_trainer(model, tmp_path / "ga", device, rows, gradient_accumulation_steps=2)
    patch(patched, 0.5)
    halves = [collate(patched, rows[:2]), collate(patched, rows[2:])]
    recorder = Recorder(patched.model)
    losses_p, count_p = window(patched, halves)
    recorder.handle.remove()

    chosen = kept_labels_by_sequence(recorder)
    assert check_selection(rows, chosen, 0.5) > 20
    masked = replay_rows(rows, chosen)
    n_kept = sum(sum(t != -100 for t in r["labels"][1:]) for r in masked)
    assert int(count_p) == n_kept  # the normalizer is the window's kept count, known before scoring

    losses_s, count_s = window(stock_ga, [collate(stock_ga, masked[:2]), collate(stock_ga, masked[2:])])
    assert int(count_s) == n_kept
    assert all(torch.equal(a, b) for a, b in zip(losses_p, losses_s))
    assert_same(grads(patched.model), grads(stock_ga.model), "GA=2 grad")

    (loss_big,), count_big = window(big, [collate(big, masked)])
    assert int(count_big) == n_kept
    # One rounding of the storage dtype per op along a ~2L+2-op path (fp32 accumulation inside every GEMM and in
    # TRL's kernel); the GA sum of two micro-batch gradients adds one more rounding of the gradient dtype. Bound:
    # 8 u sqrt(2L+2), u the unit roundoff of the model dtype: fp32 1.5e-6, bf16 0.1 (CPU measured 1e-7 and 3e-3);
    # a 2x normalizer error is 0.5.
    bound = 8 * unit_roundoff(dtype) * math.sqrt(2 * LAYERS + 2)
    loss_ga = sum(losses_p)
    assert abs(float(loss_ga) - float(loss_big)) <= bound * abs(float(loss_big))
    g_ga, g_big = grads(patched.model), grads(big.model)
    assert g_ga.keys() == g_big.keys()
    worst = max(rel(g_ga[n], g_big[n]) for n in g_big)
    assert worst <= bound, (worst, bound)


# ---- the router: the in-forward selection equals scoring the full model's hidden_states[N] ----------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_router_selection_equals_full_model_reference(dtype, device, deterministic, tmp_path):
    from leantrain.cggr.ops import score_tokens, select_topk
    from leantrain.models import decoder_parts

    rows = sft_rows()[:4]
    model = model_for(dtype)
    reference_model = copy.deepcopy(model).to(device)  # a plain model: no fused head, no router hook
    patched = sft_trainer(model, tmp_path / "p", device, rows)
    patch(patched, 0.3)
    batch = collate(patched, rows)
    recorder = Recorder(patched.model)
    window(patched, [batch])
    recorder.handle.remove()
    (_, _, got), = recorder.batches  # fmt: skip

    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.no_grad():  # same weights (before the step), same train-mode forward, same kernels and shapes
        out = reference_model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True
        )
    targets = batch["labels"][:, 1:]
    scores = score_tokens(decoder_parts(reference_model), out.hidden_states[ROUTER_LAYERS], targets, "entropy")
    keep = select_topk(scores, targets != -100, None, 0.3)
    want = batch["labels"].clone()
    want[:, 1:][~keep] = -100
    assert torch.equal(got, want)
    assert (want != -100).sum() < (batch["labels"] != -100).sum()
