"""Tiny trainers for the fused-loss tests (CPU parity and CUDA): a seeded causal LM, pre-tokenized SFT datasets whose
labels the model partly predicts (so token accuracy is neither 0 nor 1), the TRL loss paths each installed version
has, one accumulation window through the trainer's own counting, and the comparisons."""

from __future__ import annotations

import copy
import functools
import math
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import transformers

from leantrain.cli.tiny import tiny_model, train_tokenizer


VOCAB = 512
OFF = {"moe4bit": False, "grpo_logps": False, "osft": False, "cggr": False}
# The fused loss requested: these tiny heads are outside every measured cell (and nothing is measured on CPU), so auto
# mode keeps the stock loss; a test of the op asks for it (a test of the auto rule passes OFF, or measured_here).
ON = {**OFF, "fused_ce": True}
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def trl_version() -> tuple[int, ...]:
    import trl

    return tuple(int(p) for p in trl.__version__.split(".")[:2])


def has_fused_head() -> bool:
    try:
        from trl.trainer.utils import add_fused_lm_head  # noqa: F401
    except ImportError:
        return False
    return True


def sft_paths() -> list[tuple[str, str]]:
    """(loss_type, the path leantrain serves it by) for the installed TRL."""
    if has_fused_head():
        return [("nll", "trl_fused"), ("dft", "trl_fused")]
    paths = [("nll", "full_logits"), ("dft", "dft")]
    if trl_version() >= (1, 4):
        paths.insert(0, ("chunked_nll", "chunked_nll"))
    return paths


# ------------------------------------------------------------------------------------------------ models
def extra_config(family: str, **overrides: Any) -> transformers.PretrainedConfig:
    """Families beyond leantrain.cli.tiny's: Cohere (logit_scale), Granite (divides by logits_scaling) and HyperCLOVA X
    (multiplies by it; transformers 5)."""
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        tie_word_embeddings=False,
    )
    if family == "cohere":
        config = transformers.CohereConfig(**common, logit_scale=0.25)
    elif family == "granite":
        config = transformers.GraniteConfig(**common, logits_scaling=4.0)
    elif family == "hyperclovax":
        config = transformers.HyperCLOVAXConfig(**common, logits_scaling=0.5, head_dim=32)
    else:
        raise ValueError(family)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def tiny(family: str = "llama", seed: int = 0, dtype=torch.float32, head_bias: bool = False, **overrides):
    """A tiny seeded causal LM in train mode (2 layers, hidden 64, vocabulary 512); ``head_bias`` gives its LM head a
    random bias (as a model whose head has one)."""
    if family in ("cohere", "granite", "hyperclovax"):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(
            extra_config(family, **overrides), dtype=dtype, attn_implementation="eager"
        )
    else:
        model = tiny_model(family, seed=seed, dtype=dtype, vocab_size=VOCAB, hidden=64, layers=2, **overrides)
    if head_bias:
        head = model.get_output_embeddings()
        g = torch.Generator().manual_seed(seed + 1)
        head.bias = torch.nn.Parameter((torch.randn(head.out_features, generator=g) * 0.5).to(dtype))
    return model.train()


@functools.lru_cache(maxsize=2)
def _greedy_rows(n: int, seed: int) -> tuple[tuple[int, ...], ...]:
    model = tiny("llama", seed=0).eval()
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (n, 4), generator=g)
    with torch.no_grad():
        for step in range(12):
            # every other token the model's greedy choice, the rest random: accuracy near one half
            guess = torch.randint(3, VOCAB, (n,), generator=g)
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1) if step % 2 else guess
            ids = torch.cat([ids, nxt[:, None]], dim=1)
    return tuple(tuple(ids[i, : 7 + (5 * i) % 9].tolist()) for i in range(n))


def greedy_rows(model: torch.nn.Module | None = None, n: int = 8, seed: int = 1) -> list[list[int]]:
    """Rows of different lengths (7-15 tokens): a random prompt, then tokens alternately random and the greedy choice
    of the seed-0 tiny Llama, so its argmax hits about half the labels and token accuracy is neither 0 nor 1.
    Cached: the same rows for every test (``model`` is accepted for call sites' readability and ignored)."""
    return [list(r) for r in _greedy_rows(n, seed)]


def sft_dataset(rows: list[list[int]], masks: str | None = None):
    """Pre-tokenized rows; ``masks="completion"`` adds a completion mask (the first third is the prompt),
    ``masks="assistant"`` an assistant mask (the first half is not the assistant's); the collator turns either into
    -100 labels."""
    from datasets import Dataset

    records = []
    for ids in rows:
        record = {"input_ids": ids}
        if masks == "completion":
            cut = max(1, len(ids) // 3)
            record["completion_mask"] = [0] * cut + [1] * (len(ids) - cut)
        elif masks == "assistant":
            cut = len(ids) // 2
            record["assistant_masks"] = [0] * cut + [1] * (len(ids) - cut)
        records.append(record)
    return Dataset.from_list(records)


def sft_trainer(model, tmp_path, rows, *, loss_type: str | None = None, masks: str | None = None, **args: Any):
    from trl import SFTConfig, SFTTrainer

    defaults = dict(
        output_dir=str(tmp_path),
        report_to=[],
        use_cpu=model.device.type == "cpu",
        save_strategy="no",
        learning_rate=1e-3,
        per_device_train_batch_size=4,
        logging_steps=1,
        bf16=False,
        seed=0,
    )
    if loss_type is not None:
        defaults["loss_type"] = loss_type
    if masks == "completion":
        defaults["completion_only_loss"] = True
    defaults.update(args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SFTTrainer(
            model=model, args=SFTConfig(**defaults), train_dataset=sft_dataset(rows, masks),
            processing_class=train_tokenizer(),
        )  # fmt: skip


def plain_batches(rows: list[list[int]], per_batch: int = 4) -> list[dict[str, torch.Tensor]]:
    """Right-padded batches with -100 on padding and on a 2-token prompt of each row."""
    batches = []
    for start in range(0, len(rows), per_batch):
        chunk = rows[start : start + per_batch]
        width = max(len(r) for r in chunk)
        ids = torch.zeros(len(chunk), width, dtype=torch.long)
        mask = torch.zeros(len(chunk), width, dtype=torch.long)
        for i, r in enumerate(chunk):
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r)] = 1
        labels = ids.masked_fill(mask == 0, -100)
        labels[:, :2] = -100
        batches.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return batches


def plain_trainer(model, tmp_path, rows, **args: Any) -> transformers.Trainer:
    defaults = dict(
        output_dir=str(tmp_path), report_to=[], use_cpu=model.device.type == "cpu", save_strategy="no",
        learning_rate=1e-3, per_device_train_batch_size=4, logging_steps=1, seed=0,
    )  # fmt: skip
    defaults.update(args)
    data = [{k: v[i] for k, v in b.items()} for b in plain_batches(rows) for i in range(len(b["input_ids"]))]
    # equal-length rows per batch would hide padding: the collator pads each batch to its longest row
    collator = transformers.DataCollatorForSeq2Seq(train_tokenizer(), padding=True, label_pad_token_id=-100)
    return transformers.Trainer(
        model=model, args=transformers.TrainingArguments(**defaults), train_dataset=data, eval_dataset=data,
        data_collator=collator,
    )  # fmt: skip


def lora(model, **kwargs: Any):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, **kwargs)
    torch.manual_seed(0)  # the adapters' initialization: the same on both sides of a pair
    return get_peft_model(model, config)


# ---------------------------------------------------------------------------------------------- stepping
def batches_of(trainer, n: int) -> list[dict[str, torch.Tensor]]:
    """The first ``n`` collated micro-batches of the trainer's own dataloader (no shuffling between the pair)."""
    loader = trainer.get_train_dataloader()
    out = []
    for batch in loader:
        out.append({k: v for k, v in batch.items()})
        if len(out) == n:
            break
    return out


@contextmanager
def hidden_grads(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Collect d loss / d last_hidden_state of each forward (the trunk's output)."""
    from leantrain.models import unwrap_model

    trunk = unwrap_model(model).base_model
    seen: list[torch.Tensor] = []

    def hook(_module, _args, output):
        hidden = output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]
        if hidden.requires_grad:
            hidden.register_hook(lambda g: seen.append(g.detach().clone()))

    handle = trunk.register_forward_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def window(trainer, batches: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """One accumulation window through the trainer's own counting (``num_items_in_batch``) and ``training_step``:
    the micro-batch losses, every parameter gradient, the trunk-output gradients and the metrics TRL recorded."""
    trainer.model.zero_grad(set_to_none=True)
    trainer.current_gradient_accumulation_steps = len(batches)  # set by Trainer's loop; TRL's aux loss reads it
    samples, count = trainer.get_batch_samples(iter(copy.deepcopy(batches)), len(batches), trainer.args.device)
    with hidden_grads(trainer.model) as hidden:
        losses = [trainer.training_step(trainer.model, b, count).detach() for b in samples]
    grads = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: list(v) for k, v in getattr(trainer, "_metrics", {}).get("train", {}).items()}
    return {"losses": torch.stack(losses), "grads": grads, "hidden": hidden, "metrics": metrics, "count": count}


def spy_op(monkeypatch, replace: Any = None) -> list[str]:
    """Record the backend of every call of the fused op (``lm_head.ops.token_stats`` / ``head_loss``), or run
    ``replace`` instead of it."""
    from leantrain.lm_head import ops

    seen: list[str] = []
    for name in ("token_stats", "head_loss"):
        real = getattr(ops, name)

        def spy(*args, _real=real, **kwargs):
            seen.append(kwargs.get("backend"))
            return (replace or _real)(*args, **kwargs)

        monkeypatch.setattr(ops, name, spy)
    return seen


# ------------------------------------------------------------------------------------------------ checks
def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a - b‖ / ‖b‖ in fp64 (0 when both are 0)."""
    a, b = a.double(), b.double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff if denom == 0 else diff / denom


def assert_window_close(ours: dict, stock: dict, bound: float, metric_bound: float | None = None) -> None:
    """Losses, gradients and trunk-output gradients within ``bound`` (relative, norm-wise); metrics within
    ``metric_bound`` (relative; mean_token_accuracy is compared by ``assert_accuracy``)."""
    assert (ours["count"] is None) == (stock["count"] is None)
    assert stock["count"] is None or torch.equal(torch.as_tensor(ours["count"]), torch.as_tensor(stock["count"]))
    assert rel_err(ours["losses"], stock["losses"]) <= bound, (ours["losses"], stock["losses"])
    assert ours["grads"].keys() == stock["grads"].keys() and ours["grads"]
    worst = max((rel_err(ours["grads"][n], stock["grads"][n]), n) for n in stock["grads"])
    assert worst[0] <= bound, f"gradient of {worst[1]}: relative error {worst[0]:.3g} > {bound:.3g}"
    assert len(ours["hidden"]) == len(stock["hidden"]) > 0
    for a, b in zip(ours["hidden"], stock["hidden"]):
        assert rel_err(a, b) <= bound, f"trunk-output gradient: {rel_err(a, b):.3g} > {bound:.3g}"
    if metric_bound is not None:
        assert ours["metrics"].keys() == stock["metrics"].keys(), (ours["metrics"].keys(), stock["metrics"].keys())
        for key in ("entropy", "num_tokens", "aux_loss"):
            for a, b in zip(ours["metrics"].get(key, []), stock["metrics"].get(key, [])):
                assert math.isclose(a, b, rel_tol=metric_bound, abs_tol=metric_bound), (key, a, b)


def assert_accuracy(ours: dict, stock: dict, allowed: list[float] | None = None) -> None:
    """mean_token_accuracy equal (fp32), or within ``allowed[i]`` (the share of near-tied tokens, bf16)."""
    a, b = ours["metrics"]["mean_token_accuracy"], stock["metrics"]["mean_token_accuracy"]
    assert len(a) == len(b) > 0
    for i, (x, y) in enumerate(zip(a, b)):
        tol = 0.0 if allowed is None else allowed[i]
        assert abs(x - y) <= tol + 1e-12, (i, x, y, tol)


def measured_here(monkeypatch, trainer, faster: bool = True) -> None:
    """Make the dispatch rule's table one cell at ``trainer``'s head shape, on its device class, measured faster (or
    slower) for every path: the auto rule then decides as it would where a measurement exists, on any machine."""
    from leantrain.fused_ce import dispatch, probe

    model = probe.base_model(trainer)
    v, h = model.get_output_embeddings().weight.shape
    head = "trainable" if model.get_output_embeddings().weight.requires_grad else "frozen"
    dtype = probe._dtype_name(trainer, probe.HeadSettings())
    ours, stock = (1.0, 2.0) if faster else (2.0, 1.0)
    cells = [
        dispatch.Measured(path, head, 1024, h, v, dtype, trainer.args.device.type, stock, ours)
        for path in dispatch.PATHS
    ]
    monkeypatch.setattr(dispatch, "MEASURED", tuple(cells))
