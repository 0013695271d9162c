"""``compile_layers_background=True`` on CPU (inductor): the layers compile in a child process while the traced
layers run, and the compiled code takes over at a step boundary from inductor's cache.

Exact where the math is: until the switch the traced graph runs the stock layer's ops, so the loss and every
gradient equal the eager run's bits (``torch.equal``); after it, the layers run what inductor compiled in this process
for the same graph, so they equal an in-process ``compile_layers=True`` run's bits on the same weights and batch.
That the switch compiles nothing is checked on inductor's counters: both graphs (forward and backward) hit the FX-graph
cache the child filled, with no miss, in a cache directory of the test's own. Also: a Trainer run switches at a step
boundary and trains within fp32 rounding of stock; a failing child falls back once (strict raises); a graph that
cannot be handed over compiles in the training process; contradictory options raise; unpatching stops the children.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import transformers
from transformers import Trainer, TrainerCallback, TrainingArguments

import leantrain
from leantrain import Status
from leantrain.compile_layers import stats
from leantrain.compile_layers.patch import BackgroundCompileError
from leantrain.compiling import background
from testkit.batches import pad_right, random_rows
from testkit.optimizations import others_off
from tests._compile_background import BACKGROUND, background_against_references, held_child
from tests._moe4bit_model import make_trainer


pytest.importorskip("torch._inductor")
pytestmark = [
    pytest.mark.skipif(int(transformers.__version__.split(".")[0]) < 5, reason="compile_layers declines on 4.x"),
    pytest.mark.usefixtures("fresh_dynamo", "own_inductor_cache"),
]


def token_batch(seed: int) -> dict[str, torch.Tensor]:
    from tests._moe4bit_model import SEQ, VOCAB

    ids = torch.randint(3, VOCAB, (4, SEQ), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


@pytest.mark.slow
def test_moe_layers_compile_in_a_child_while_the_traced_layers_run(tmp_path, monkeypatch):
    """MoE layers with moe4bit's grouped 4-bit experts (its custom ops: the child imports their module) under
    non-reentrant checkpointing: a recompute in the same step runs the path its forward ran."""
    pytest.importorskip("bitsandbytes")
    from tests._moe4bit_model import make_model

    def make():
        model = make_model("qwen3_moe", "stacked")
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model

    options = {**others_off("compile_layers"), "moe4bit": True}
    background_against_references(make, make_trainer, options, (token_batch(0), token_batch(1)), tmp_path, monkeypatch)


@pytest.mark.slow
def test_lora_layers_compile_in_a_child_under_autocast(tmp_path, monkeypatch):
    """Dense LoRA layers, their forward under bf16 autocast as the trainer would run it: the child compiles under
    the same autocast state, so the cache entries are the ones this process looks up."""
    peft = pytest.importorskip("peft")
    from leantrain.cli.tiny import tiny_model

    def make():
        model = tiny_model("llama", vocab_size=256, hidden=64, layers=2).train()
        torch.manual_seed(1)
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
        return peft.get_peft_model(model, lora)

    batches = tuple({"input_ids": b["input_ids"], "labels": b["labels"]} for b in (token_batch(2), token_batch(3)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        background_against_references(make, make_trainer, others_off("compile_layers"), batches, tmp_path, monkeypatch)


@pytest.mark.slow
def test_qlora_layers_compile_in_a_child(tmp_path, monkeypatch):
    """bitsandbytes 4-bit linears under LoRA: their ``Params4bit`` weights reach the graph as parameters that add
    attributes only, which the child stands in for with plain tensors (the same compiled code, the same cache keys)."""
    peft = pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from leantrain.cli.tiny import tiny_model
    from testkit.moe4bit_models import load_in_4bit_like

    def make():
        model = tiny_model("llama", vocab_size=256, hidden=64, layers=2).train()
        load_in_4bit_like(model)
        torch.manual_seed(1)
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
        return peft.get_peft_model(model, lora)

    # and with another intra-op thread count than a fresh process's (a test before may leave one): inductor's CPU
    # code is built for it, so the child must build for the same
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if threads > 1 else 2)
    try:
        batches = (token_batch(4), token_batch(5))
        background_against_references(make, make_trainer, others_off("compile_layers"), batches, tmp_path, monkeypatch)
    finally:
        torch.set_num_threads(threads)


class WaitAfterFirstStep(TrainerCallback):
    """Holds the run after its first step until the children have finished: the switch comes at step 2's start."""

    def __init__(self) -> None:
        self.trainer = None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == 1:
            stats(self.trainer).background.wait(timeout_s=300)


def tiny_trainer(tmp_path, steps: int = 3) -> Trainer:
    from leantrain.cli.tiny import tiny_model

    args = TrainingArguments(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-3,
        per_device_train_batch_size=2, max_steps=steps, logging_steps=1, disable_tqdm=True, seed=0,
    )  # fmt: skip
    model = tiny_model("llama", vocab_size=256, hidden=64, layers=2).train()
    return Trainer(model=model, args=args, train_dataset=random_rows(8, (12,), 256), data_collator=pad_right)


@pytest.mark.slow
def test_a_trainer_run_switches_at_a_step_boundary_and_trains_as_stock(tmp_path):
    stock = tiny_trainer(tmp_path / "stock")
    stock.train()
    trainer = tiny_trainer(tmp_path / "bg")
    waiter = WaitAfterFirstStep()
    waiter.trainer = trainer
    trainer.add_callback(waiter)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback here would hide a failure
        report = leantrain.patch_trainer(trainer, **others_off("compile_layers"), **BACKGROUND)
        trainer.train()
    assert report["compile_layers"].status is Status.APPLIED
    live = stats(trainer).background
    (job,) = live.jobs.values()
    assert job.done and job.seconds > 0 and live.retraced == 1 and stats(trainer).compiles == 1
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    want = [h["loss"] for h in stock.state.log_history if "loss" in h]
    assert losses[0] == want[0]  # step 1 ran the traced graph: stock's bits
    # then inductor's fused kernels (fp32 reductions reordered, ~1e-7 relative per op; see test_compile_layers.py)
    assert losses[1:] == pytest.approx(want[1:], rel=1e-5)


class HoldTheChild(TrainerCallback):
    """Records, per step, the traced graph's calls and whether the eager layers served; releases the held child
    after step 2 and waits for it, so the switch comes at step 3's start."""

    def __init__(self, trainer: Trainer, release, traced: list) -> None:
        self.trainer, self.release, self.traced, self.steps = trainer, release, traced, []

    def on_step_end(self, args, state, control, **kwargs):
        live = stats(self.trainer).background
        self.steps.append((len(self.traced), live.eager))
        if state.global_step == 2:
            self.release.touch()
            live.wait(timeout_s=300)


@pytest.mark.slow
def test_while_the_child_compiles_the_eager_layers_serve(tmp_path, monkeypatch):
    """The step that traced runs the traced graph; the steps after it, until the child has finished, run the eager
    layers (what a run without compile runs); then the compiled code. Exact where the math is."""
    release, traced = held_child(tmp_path, monkeypatch)
    stock = tiny_trainer(tmp_path / "stock", steps=4)
    stock.train()
    trainer = tiny_trainer(tmp_path / "bg", steps=4)
    hold = HoldTheChild(trainer, release, traced)
    trainer.add_callback(hold)
    leantrain.patch_trainer(trainer, **others_off("compile_layers"), **BACKGROUND)
    trainer.train()
    step1, step2, step3, step4 = hold.steps
    assert step1 == (step1[0], False) and step1[0] > 0  # the traced graph
    assert step2 == (step1[0], True)  # the eager layers: no traced call
    assert step3 == step4 == (step1[0], False)  # the compiled code: called by Dynamo, not through the job
    live = stats(trainer).background
    assert live.eager_steps == 1 and live.retraced == len(live.jobs) and all(j.done for j in live.jobs.values())
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    want = [h["loss"] for h in stock.state.log_history if "loss" in h]
    assert losses[:2] == want[:2]  # the traced graph and the eager layers: stock's bits
    assert losses[2:] == pytest.approx(want[2:], rel=1e-5)  # inductor's kernels (see the test above)


def failing_child_trainer(tmp_path, monkeypatch, **patch) -> Trainer:
    """A 3-step run whose child cannot start (no such module), held after step 1 until it has exited."""
    monkeypatch.setattr(background, "CHILD_MODULE", "leantrain.compiling._no_such_child")
    trainer = tiny_trainer(tmp_path)
    waiter = WaitAfterFirstStep()
    waiter.trainer = trainer
    trainer.add_callback(waiter)
    leantrain.patch_trainer(trainer, **others_off("compile_layers"), **BACKGROUND, **patch)
    return trainer


@pytest.mark.expect_fallback
def test_a_failing_child_falls_back_once_and_training_goes_on(tmp_path, monkeypatch):
    trainer = failing_child_trainer(tmp_path, monkeypatch)
    with pytest.warns(RuntimeWarning, match="the background compile failed: .*No module named") as caught:
        trainer.train()
    assert len([w for w in caught if "compile_layers failed" in str(w.message)]) == 1
    assert trainer.leantrain_report["compile_layers"].status is Status.FAILED
    assert trainer.state.global_step == 3


def test_strict_mode_raises_when_the_child_fails(tmp_path, monkeypatch):
    trainer = failing_child_trainer(tmp_path, monkeypatch, strict=True)
    with pytest.raises(BackgroundCompileError, match="No module named"):
        trainer.train()


def test_a_graph_that_cannot_be_handed_over_compiles_here(tmp_path, monkeypatch):
    def refuse(gm):
        raise TypeError("not picklable here")

    monkeypatch.setattr(background, "graph_bytes", refuse)
    trainer = tiny_trainer(tmp_path, steps=1)
    leantrain.patch_trainer(trainer, **others_off("compile_layers"), **BACKGROUND)
    trainer.train()
    live = stats(trainer).background
    assert not live.jobs and stats(trainer).compiles == 1
    assert live.in_process == ["the graph could not be handed to a child process (TypeError: not picklable here)"]


def test_without_room_for_a_child_the_layers_compile_here(tmp_path, monkeypatch):
    """The device has too little free memory after the first step: no child starts, the next step compiles in the
    training process (as without the background option) and training goes on, nothing failed."""
    reason = "0.50 GiB free on cuda:0 after the first step (a test's stand-in)"
    checked = []
    monkeypatch.setattr(background, "room_for_child", lambda devices: checked.append(devices) or reason)
    trainer = tiny_trainer(tmp_path, steps=3)
    leantrain.patch_trainer(trainer, **others_off("compile_layers"), **BACKGROUND)
    trainer.train()
    live = stats(trainer).background
    assert checked and live.jobs and live.in_process == [reason] * len(live.jobs)
    assert all(j.process is None and j.done and j.here == reason for j in live.jobs.values())
    assert (live.retraced, live.eager_steps, live.eager) == (0, 0, False)
    assert trainer.leantrain_report["compile_layers"].status is Status.APPLIED
    assert trainer.state.global_step == 3 and not list(tmp_path.glob("**/child.log"))


def test_unpatch_stops_the_children_and_removes_their_files(tmp_path):
    trainer = tiny_trainer(tmp_path)
    leantrain.patch_trainer(trainer, **others_off("compile_layers"), **BACKGROUND)
    batch = token_batch(0)
    trainer.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss.backward()
    live = stats(trainer).background
    (job,) = live.jobs.values()
    assert job.process is None and live.start() == 1  # the child starts at a step boundary (here: by hand)
    assert job.process.poll() is None and job.directory.exists()
    leantrain.unpatch_trainer(trainer)
    assert job.process.poll() is not None and not job.directory.parent.exists()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"compile_layers_backend": "aot_eager"}, "needs compile_layers_backend='inductor'"),
        ({"compile_layers_dynamic": "always"}, "needs compile_layers_dynamic='auto'"),
    ],
)
def test_contradictory_options_raise_at_patch_time(tmp_path, options, message):
    trainer = tiny_trainer(tmp_path)
    with pytest.raises(ValueError, match=message):
        leantrain.patch_trainer(trainer, **BACKGROUND, **options)
