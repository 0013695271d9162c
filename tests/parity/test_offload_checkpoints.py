"""Offloaded activation checkpoints on CPU against stock checkpointing.

The hooks move a checkpointed layer's input to host memory and hand back an exact copy for the recompute, so in fp32
the losses, gradients and weights must equal stock checkpointing's bit for bit (``torch.equal``), in both of torch's
checkpoint modes. On the host the copy is a clone (there is no device memory to free); what these tests pin is the
mechanism a GPU run relies on: the hooks see the checkpoint's inputs and nothing else, every input comes back, the
originals are released after the forward, the host budget and a failed host copy leave inputs on the device, and the
trainer-level wiring (checkpointing switched on at ``train()``, gradient accumulation, LoRA, compiled layers inside
the checkpoint, unpatching). The CUDA path (pinned memory, side stream, copies one layer ahead) is tested against
stock on the GPU in tests/gpu/test_offload_checkpoints_cuda.py."""

from __future__ import annotations

import dataclasses
import gc
import weakref

import pytest
import torch
import transformers
from transformers import Trainer, TrainingArguments

import leantrain
from leantrain import NotReadyError, Status
from leantrain.cli.tiny import tiny_model
from leantrain.offload_checkpoints import hooks, stats
from leantrain.offload_checkpoints import measured as offload_measured
from leantrain.offload_checkpoints import patch as offload_patch
from leantrain.offload_checkpoints import probe as offload_probe
from leantrain.offload_checkpoints.ops import (
    GIB,
    EmbeddingOutput,
    HostOffload,
    PinnedPool,
    host_budget_bytes,
    spread_layers,
)
from testkit.batches import pad_right, random_rows
from testkit.optimizations import only
from tests._offload_blocks import through_checkpoints


VOCAB = 256
HIDDEN, LAYERS, BATCH, LENGTH = 64, 3, 2, 12
TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
needs_5 = pytest.mark.skipif(not TRANSFORMERS_5, reason="compile_layers declines on transformers 4.x")


# -- the hooks, on a stack of checkpointed blocks
def blocks(seed: int = 0) -> torch.nn.ModuleList:
    torch.manual_seed(seed)
    return torch.nn.ModuleList(
        torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16)) for _ in range(LAYERS)
    )


def forward_backward(stack, offload: HostOffload | None, reentrant: bool, seen: list | None = None):
    """The stack's loss and gradients, each block checkpointed (inside the hooks when ``offload`` is given);
    ``seen`` collects a weak reference to every block input."""
    torch.manual_seed(1)
    h = torch.randn(4, 16, requires_grad=True)
    # h * 1.0: a non-leaf, which nothing but the checkpoint holds after the forward
    loss = through_checkpoints(stack, h * 1.0, offload, reentrant, seen).pow(2).sum()
    gc.collect()
    alive = [ref() is not None for ref in seen] if seen is not None else None
    loss.backward()
    return loss.detach(), h.grad, [p.grad for p in stack.parameters()], alive


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_hooks_move_every_checkpoint_input_and_nothing_else(reentrant):
    stock = forward_backward(blocks(), None, reentrant)
    offload = HostOffload(budget_bytes=GIB)
    ours = forward_backward(blocks(), offload, reentrant)
    assert torch.equal(ours[0], stock[0]) and torch.equal(ours[1], stock[1])
    assert all(torch.equal(a, b) for a, b in zip(ours[2], stock[2], strict=True))
    one = 4 * 16 * 4  # a block input: 4 x 16 fp32
    assert (offload.stats.packed, offload.stats.packed_bytes, offload.stats.peak_bytes) == (
        LAYERS,
        LAYERS * one,
        LAYERS * one,
    )
    assert offload.stats.live_bytes == 0  # every host copy dropped once the backward used it
    assert offload.stats.kept == 0 and not offload.failed


@pytest.mark.parametrize("reentrant", [False, True])
def test_a_leaf_input_that_requires_grad_stays_on_the_device(reentrant):
    """The first block's input is a leaf that requires grad (what PEFT's input-gradient hook makes of the embedding
    output): its AccumulateGrad node holds it until the backward ends, so it is left where it is (a host copy would
    free nothing and the copy back would duplicate it) and counted; the other inputs move; training is stock's."""

    def run(offload: HostOffload | None):
        torch.manual_seed(1)
        h = torch.randn(4, 16, requires_grad=True)
        stack = blocks()
        through_checkpoints(stack, h, offload, reentrant).pow(2).sum().backward()
        return h.grad, [p.grad for p in stack.parameters()]

    stock = run(None)
    offload = HostOffload(budget_bytes=GIB)
    ours = run(offload)
    assert torch.equal(ours[0], stock[0])
    assert all(torch.equal(a, b) for a, b in zip(ours[1], stock[1], strict=True))
    assert (offload.stats.leaves, offload.stats.packed, offload.stats.kept) == (1, LAYERS - 1, 0)
    assert offload.stats.live_bytes == 0


def test_the_originals_are_released_after_the_forward():
    """Stock non-reentrant checkpointing keeps each block's input alive until the backward; offloaded, the host copy
    is all that stays (on CUDA the newest input stays on the device: the backward needs it first)."""
    stock_alive = forward_backward(blocks(), None, False, [])[3]
    ours_alive = forward_backward(blocks(), HostOffload(budget_bytes=GIB), False, [])[3]
    assert stock_alive == [True] * LAYERS
    assert ours_alive == [False] * LAYERS


def test_inputs_past_the_host_budget_stay_on_the_device():
    stock = forward_backward(blocks(), None, False)
    offload = HostOffload(budget_bytes=2 * 4 * 16 * 4)  # room for two block inputs
    ours = forward_backward(blocks(), offload, False)
    assert torch.equal(ours[1], stock[1])
    assert (offload.stats.packed, offload.stats.kept) == (2, LAYERS - 2)


def test_small_inputs_stay_on_the_device():
    offload = HostOffload(budget_bytes=GIB, min_bytes=4 * 16 * 4 + 1)
    forward_backward(blocks(), offload, False)
    assert offload.stats.packed == 0 and offload.stats.kept == 0


@pytest.mark.parametrize("min_tokens", [4, 5])
def test_inputs_of_fewer_tokens_than_the_minimum_stay_on_the_device(min_tokens):
    """``min_tokens`` (auto mode's measured micro-batch size): each block input here is 4 tokens of 16 features."""
    stock = forward_backward(blocks(), None, False)
    offload = HostOffload(budget_bytes=GIB, min_tokens=min_tokens)
    ours = forward_backward(blocks(), offload, False)
    assert torch.equal(ours[1], stock[1]) and all(map(torch.equal, ours[2], stock[2]))
    moved = min_tokens <= 4
    assert (offload.stats.packed, offload.stats.short) == ((LAYERS, 0) if moved else (0, LAYERS))


def test_an_empty_tensor_stays_where_it_is():
    """torch <= 2.11's non-reentrant checkpoint saves a 0-element dummy beside the inputs: not an input to move."""
    offload = HostOffload(budget_bytes=GIB)
    dummy = torch.empty((0,), requires_grad=True)
    assert offload.pack(dummy) is dummy and offload.stats.packed == 0


def test_a_failed_host_copy_keeps_every_later_input_on_the_device(monkeypatch):
    failures = []
    offload = HostOffload(budget_bytes=GIB, on_failure=failures.append)
    calls = []

    def refuse(tensor, nbytes, device):
        calls.append(1)
        raise RuntimeError("CUDA error: out of memory (pinned host allocation)")

    monkeypatch.setattr(offload, "_to_host", refuse)
    stock = forward_backward(blocks(), None, True)
    ours = forward_backward(blocks(), offload, True)
    assert torch.equal(ours[1], stock[1])
    assert len(calls) == 1 and len(failures) == 1 and "pinned host allocation" in failures[0]
    assert offload.failed and offload.stats.packed == 0


def pool_of(budget: int) -> tuple[PinnedPool, list[int]]:
    """A pool over plain host buffers, and the sizes it allocated."""
    allocated: list[int] = []

    def allocate(nbytes: int) -> torch.Tensor:
        allocated.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    return PinnedPool(budget, allocate), allocated


def test_the_pool_reuses_the_smallest_free_buffer_that_holds_a_request():
    pool, allocated = pool_of(budget=1 << 20)
    a, b = pool.take(3000), pool.take(9000)  # new buffers: powers of two
    assert (a.numel(), b.numel()) == (4096, 16384) and allocated == [4096, 16384] and pool.held_bytes == 20480
    pool.give(b)
    pool.give(a)
    assert pool.take(2000) is a  # the smallest that holds it, not the first given back
    assert pool.take(4097) is b  # a shorter step's request takes a longer step's buffer: nothing new pinned
    assert allocated == [4096, 16384] and pool.held_bytes == 20480
    assert pool.take(4096).numel() == 4096 and allocated[-1] == 4096  # none free: a new one


def test_the_pool_keeps_its_buffers_within_the_budget_releasing_free_ones_first():
    pool, allocated = pool_of(budget=24576)
    a, in_use = pool.take(8192), pool.take(8192)
    pool.give(a)
    c = pool.take(16384)  # 8192 in use + 8192 free + 16384 new would pass 24576: the free one goes first
    assert c.numel() == 16384 and pool.held_bytes == 24576 and allocated == [8192, 8192, 16384]
    assert in_use.numel() == 8192  # the buffer in use is never released
    assert pool.take(1) is None and pool.held_bytes == 24576  # nothing free, nothing new fits: the input stays
    pool.give(c)
    assert pool.take(100) is c  # free again: reused, whatever its size
    small, _ = pool_of(budget=5000)
    assert small.take(4500).numel() == 4500  # a power of two past the budget: the exact size where that fits


def test_a_buffer_hands_out_its_last_typed_view_again_and_drops_it_when_released():
    pool, _ = pool_of(budget=16384)
    buffer = pool.take(8192)
    view = pool.typed(buffer, torch.bfloat16, torch.Size([2, 3, 4]))
    assert view.shape == (2, 3, 4) and view.dtype == torch.bfloat16 and view.data_ptr() == buffer.data_ptr()
    assert pool.typed(buffer, torch.bfloat16, torch.Size([2, 3, 4])) is view  # the next layer, the next step
    assert pool.typed(buffer, torch.float32, torch.Size([2, 3, 4])).dtype == torch.float32  # another input: new
    other = pool.typed(buffer, torch.bfloat16, torch.Size([5, 7]))
    assert other is not view and other.shape == (5, 7)
    other.copy_(torch.arange(35, dtype=torch.bfloat16).view(5, 7))
    assert torch.equal(buffer[:70].view(torch.bfloat16), torch.arange(35, dtype=torch.bfloat16))
    gone = weakref.ref(buffer)
    pool.give(buffer)
    del buffer, view, other
    assert gone() is not None  # free, kept by the pool for the next request
    pool.take(16384)  # past the budget with it: released, and its kept view with it
    assert gone() is None


def test_each_devices_buffers_are_its_own():
    """A device's buffers are copied on its own side stream: reuse is safe in that stream's order only."""
    pool, allocated = pool_of(budget=1 << 20)
    pool.give(pool.take(4096, 0), 0)
    assert pool.take(4096, 1) is not None and len(allocated) == 2  # device 1 does not get device 0's buffer
    assert pool.take(4096, 0) is not None and len(allocated) == 2


def test_host_budget_arithmetic():
    assert host_budget_bytes(2.5, 10 * GIB, 4) == int(2.5 * GIB)  # the option wins
    assert host_budget_bytes(0, 10 * GIB, 1) == 5 * GIB  # half of what is available
    assert host_budget_bytes(0, 10 * GIB, 4) == 5 * GIB // 4  # shared by the host's processes


# -- the trainer
def tiny() -> torch.nn.Module:
    return tiny_model("llama", vocab_size=VOCAB, hidden=HIDDEN, layers=LAYERS).train()


def checkpointed(reentrant: bool = False, **args) -> dict:
    return {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": reentrant}, **args}


def trainer_for(model, tmp_path, **args) -> Trainer:
    config = dict(
        output_dir=str(tmp_path), report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-3,
        per_device_train_batch_size=BATCH, max_steps=3, logging_steps=1, disable_tqdm=True, seed=0,
    )  # fmt: skip
    config.update(args)
    rows = random_rows(8, (LENGTH,), VOCAB)
    return Trainer(model=model, args=TrainingArguments(**config), train_dataset=rows, data_collator=pad_right)


def run(make_model, tmp_path, patch: dict | None, **args):
    """Train; return (losses, weights, trainer)."""
    trainer = trainer_for(make_model(), tmp_path, **args)
    if patch is not None:
        leantrain.patch_trainer(trainer, **{**only("offload_checkpoints"), **patch})
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return losses, weights, trainer


def assert_same_run(stock, ours) -> None:
    assert ours[0] == stock[0], f"losses {ours[0]} vs stock {stock[0]}"
    for name, w in stock[1].items():
        assert torch.equal(ours[1][name], w), f"{name} differs from the stock run"


@pytest.mark.parametrize("reentrant", [False, True])
def test_trains_exactly_as_stock_checkpointing(reentrant, tmp_path):
    stock = run(tiny, tmp_path, None, **checkpointed(reentrant))
    ours = run(tiny, tmp_path, {"offload_checkpoints": True}, **checkpointed(reentrant))
    assert_same_run(stock, ours)
    outcome = ours[2].leantrain_report["offload_checkpoints"]
    assert outcome.status is Status.APPLIED and len(outcome.targets) == LAYERS
    assert "no device memory to save" in outcome.detail
    live = stats(ours[2])
    assert live.packed == LAYERS * 3  # every layer, every step: checkpointing was switched on at train()
    assert live.peak_bytes == LAYERS * BATCH * LENGTH * HIDDEN * 4 and live.live_bytes == 0


def test_some_layers_move_spread_over_the_stack_and_train_as_stock(tmp_path):
    """offload_checkpoints_layers=2 of 3: those two layers' inputs move, the middle one stays as stock checkpointing
    keeps it; the run is stock's to the bit."""
    stock = run(tiny, tmp_path, None, **checkpointed())
    ours = run(tiny, tmp_path, {"offload_checkpoints": True, "offload_checkpoints_layers": 2}, **checkpointed())
    assert_same_run(stock, ours)
    outcome = ours[2].leantrain_report["offload_checkpoints"]
    assert outcome.targets == ("model.layers.0", "model.layers.2"), outcome.targets
    assert "the checkpointed inputs of 2 of 3 decoder layers" in outcome.detail, outcome.detail
    live = stats(ours[2])
    assert live.packed == 2 * 3 and live.peak_bytes == 2 * BATCH * LENGTH * HIDDEN * 4


def test_more_layers_than_the_model_has_are_refused(tmp_path):
    trainer = trainer_for(tiny(), tmp_path, **checkpointed())
    with pytest.raises(NotReadyError, match=f"offload_checkpoints_layers=4 but the model has {LAYERS} decoder layers"):
        leantrain.patch_trainer(trainer, offload_checkpoints_layers=4, **only("offload_checkpoints"))
    with pytest.raises(ValueError, match=r"offload_checkpoints_layers.*must be in \[0, 4096\], got -1"):
        leantrain.patch_trainer(trainer, offload_checkpoints_layers=-1, **only("offload_checkpoints"))


@pytest.mark.parametrize(
    ("total", "count", "chosen"),
    [(16, 8, list(range(1, 16, 2))), (16, 0, list(range(16))), (16, 16, list(range(16))), (3, 2, [0, 2]),
     (16, 1, [8]), (4, 3, [0, 2, 3])],
)  # fmt: skip
def test_the_layers_spread_evenly(total, count, chosen):
    assert spread_layers(total, count) == chosen
    for total in range(1, 65):
        for count in range(1, total + 1):
            picked = spread_layers(total, count)
            assert len(set(picked)) == count and picked == sorted(picked) and 0 <= picked[0] and picked[-1] < total


def test_gradient_accumulation_and_lora_train_as_stock(tmp_path):
    peft = pytest.importorskip("peft")

    def make():
        torch.manual_seed(1)
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
        return peft.get_peft_model(tiny(), lora)

    args = checkpointed(gradient_accumulation_steps=2, max_steps=2)
    stock = run(make, tmp_path, None, **args)
    ours = run(make, tmp_path, {"offload_checkpoints": True}, **args)
    assert_same_run(stock, ours)
    live = stats(ours[2])
    # layers x micro-batches x steps; layer 0's input stays where the trainer makes the embedding output a leaf that
    # requires grad (transformers' Trainer calls enable_input_require_grads on a PEFT model from 5.x)
    assert live.packed + live.leaves == LAYERS * 2 * 2 and live.leaves in (0, 2 * 2)


def peft_with_input_gradients() -> torch.nn.Module:
    """What TRL's trainers make of a PEFT model under checkpointing: ``enable_input_require_grads`` turns the
    embedding output, layer 0's input, into a leaf that requires grad."""
    peft = pytest.importorskip("peft")
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    model = peft.get_peft_model(tiny(), lora)
    model.enable_input_require_grads()
    return model


@pytest.mark.parametrize("reentrant", [False, True])
def test_the_embedding_output_goes_on_without_the_gradient_only_peft_asked_for(reentrant, tmp_path):
    """The hook-made leaf is handed to layer 0 as a tensor whose gradient is dropped: every parameter trains exactly
    as stock's (both checkpoint modes), layer 0's input moves like the others, and the leaf itself is freed once
    the forward is done (autograd no longer holds it through the backward)."""
    args = checkpointed(reentrant, max_steps=2)
    stock = run(peft_with_input_gradients, tmp_path, None, **args)
    ours = run(peft_with_input_gradients, tmp_path, {"offload_checkpoints": True}, **args)
    assert_same_run(stock, ours)
    live = stats(ours[2])
    assert (live.sunk, live.leaves, live.packed) == (2, 0, LAYERS * 2)  # per step: every layer's input moved

    model = ours[2].model
    outputs = []
    hook = model.get_input_embeddings().register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out)))
    ids = torch.randint(0, VOCAB, (BATCH, LENGTH))
    loss = model(input_ids=ids, labels=ids).loss
    hook.remove()
    gc.collect()
    assert outputs[0]() is None  # stock: alive until the backward ends (its AccumulateGrad node)
    loss.backward()


def test_the_gradient_sink_gives_the_values_and_drops_the_gradient():
    embedding = EmbeddingOutput()
    leaf = torch.randn(3, 4).requires_grad_()
    embedding.record(None, (), leaf)
    assert embedding.only_hook_made(leaf) and not embedding.only_hook_made(leaf * 1.0)
    assert not embedding.only_hook_made(torch.randn(3, 4).requires_grad_())  # another leaf: a user's, not the hook's
    sunk = embedding.sink(leaf)
    assert torch.equal(sunk, leaf) and sunk.requires_grad and not sunk.is_leaf
    (sunk * 2).sum().backward()
    assert leaf.grad is None


def test_a_leaf_the_embedding_did_not_make_stays_on_the_device(tmp_path):
    """A leaf that requires grad handed to layer 0 by the caller (``inputs_embeds``): its gradient may be wanted, so
    it is neither sunk nor moved (autograd holds it), and it gets stock's gradient."""
    peft = pytest.importorskip("peft")
    grads = []
    for patch in (None, {"offload_checkpoints": True}):
        torch.manual_seed(1)
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
        model = peft.get_peft_model(tiny(), lora)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        trainer = trainer_for(model, tmp_path, **checkpointed())
        if patch:
            leantrain.patch_trainer(trainer, **{**only("offload_checkpoints"), **patch})
        torch.manual_seed(2)
        embeds = torch.randn(BATCH, LENGTH, HIDDEN, requires_grad=True)
        model(inputs_embeds=embeds, labels=torch.randint(0, VOCAB, (BATCH, LENGTH))).loss.backward()
        grads.append(embeds.grad)
        if patch:
            assert (stats(trainer).sunk, stats(trainer).leaves) == (0, 1)
    assert torch.equal(grads[0], grads[1])


def same_run_compiled_with_offload(make, tmp_path):
    """A checkpointed run of ``make()``'s model stock, then with the offload around compiled layers (aot_eager: the
    same aten kernels), asserted to train as stock; the patched run."""
    torch._dynamo.reset()
    stock = run(make, tmp_path, None, **checkpointed())
    patch = {"offload_checkpoints": True, "compile_layers": True, "compile_layers_backend": "aot_eager"}
    ours = run(make, tmp_path, patch, **checkpointed())
    torch._dynamo.reset()
    assert_same_run(stock, ours)
    return ours


@needs_5
def test_compiled_layers_stay_inside_the_checkpoint(tmp_path):
    """compile_layers binds the compiled forward first; the offload wraps it, so the compiled region is recomputed
    inside the checkpoint and the hooks see its input only (aot_eager: the same aten kernels, exact in fp32)."""
    ours = same_run_compiled_with_offload(tiny, tmp_path)
    report = ours[2].leantrain_report
    assert report["compile_layers"].status is Status.APPLIED and report["offload_checkpoints"].status is Status.APPLIED
    assert stats(ours[2]).packed == LAYERS * 3


@needs_5
def test_the_sunk_embedding_output_compiles_as_the_other_layer_inputs(tmp_path):
    """Layer 0's input handed on without its gradient has the same requires_grad as the other layers' inputs: the
    one compiled code serves every layer without a recompile, and training is stock's (aot_eager, exact in fp32)."""
    from leantrain import compile_layers

    ours = same_run_compiled_with_offload(peft_with_input_gradients, tmp_path)
    assert stats(ours[2]).sunk == 3 and compile_layers.stats(ours[2]).recompiles == 0


@pytest.mark.expect_fallback
def test_a_failed_host_copy_warns_once_and_training_goes_on(tmp_path, monkeypatch):
    def refuse(self, tensor, nbytes, device):
        raise RuntimeError("cudaHostAlloc failed: out of memory")

    monkeypatch.setattr(HostOffload, "_to_host", refuse)
    stock = run(tiny, tmp_path, None, **checkpointed())
    with pytest.warns(RuntimeWarning, match="offload_checkpoints failed at run time") as warned:
        ours = run(tiny, tmp_path, {"offload_checkpoints": True}, **checkpointed())
    assert_same_run(stock, ours)
    assert len([w for w in warned if "offload_checkpoints" in str(w.message)]) == 1
    outcome = ours[2].leantrain_report["offload_checkpoints"]
    assert outcome.status is Status.FAILED and "stock checkpointing" in outcome.reasons[0]


def test_a_paused_offload_leaves_that_steps_inputs_on_the_device_and_trains_as_stock(tmp_path):
    """``hooks(trainer).paused`` set before step 2 and cleared before step 3: step 2 moves nothing, the others move
    every layer's input, and the run equals stock checkpointing's."""

    class PauseSecondStep(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            hooks(trainer).paused = state.global_step == 1  # the second step (0-based before it runs)
            packed_before.append(stats(trainer).packed)

    stock = run(tiny, tmp_path, None, **checkpointed())
    trainer = trainer_for(tiny(), tmp_path, **checkpointed())
    leantrain.patch_trainer(trainer, **only("offload_checkpoints"))
    packed_before: list[int] = []
    trainer.add_callback(PauseSecondStep())
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert_same_run(stock, (losses, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}))
    assert packed_before == [0, LAYERS, LAYERS] and stats(trainer).packed == 2 * LAYERS
    leantrain.unpatch_trainer(trainer)
    assert hooks(trainer) is None


def test_unpatch_restores_the_layers(tmp_path):
    """The checkpoint function the trainer set at train() was wrapped; unpatching gives back the trainer's own."""
    trainer = trainer_for(tiny(), tmp_path, **checkpointed(), max_steps=1)
    leantrain.patch_trainer(trainer, **only("offload_checkpoints"))
    trainer.train()
    layers = trainer.model.model.layers
    wrapped = [layer._gradient_checkpointing_func for layer in layers]
    assert all(hasattr(func, offload_patch.INNER) for func in wrapped)
    leantrain.unpatch_trainer(trainer)
    assert [layer._gradient_checkpointing_func for layer in layers] == [
        getattr(f, offload_patch.INNER) for f in wrapped
    ]
    assert stats(trainer) is None


def test_auto_mode_waits_for_a_measurement(tmp_path):
    report = leantrain.patch_trainer(trainer_for(tiny(), tmp_path, **checkpointed()), environ={})
    outcome = report["offload_checkpoints"]
    assert outcome.status is Status.SKIPPED and outcome.reasons[0].startswith("not measured on cpu")


def test_on_cuda_auto_mode_moves_micro_batches_from_the_measured_size():
    """Auto mode on CUDA: on for micro-batches of at least ``AUTO_MIN_TOKENS`` tokens, the size from which every
    measured case cost at most 3% of the step; a trainer told of shorter micro-batches gets the reason with the
    measurement (the report adds the switch, once); an untold one gets the offload, which leaves shorter micro-batches
    as stock at run time. A measurement over 3% at that size turns it off everywhere."""
    from leantrain.entry import skipped_as_slower

    least = offload_measured.AUTO_MIN_TOKENS
    assert offload_measured.within_from(least)
    assert offload_probe.auto_reason("cuda", least) is None and offload_probe.auto_reason("cuda", None) is None
    reason = offload_probe.auto_reason("cuda", least - 1)
    assert reason is not None and f"at most {least - 1} tokens" in reason and f"only from {least} tokens" in reason
    assert "llama-3.2-1b-qlora 0.43 GiB less at +5.9%" in reason and "GPU memory" in reason  # the runs quoted
    assert skipped_as_slower("offload_checkpoints", reason).count("offload_checkpoints=True") == 1
    shared = offload_probe.auto_reason("cuda", least, processes=8)  # 8 processes' copies through one host's memory
    assert shared is not None and "not measured with 8 processes on the host" in shared
    costly = tuple(
        dataclasses.replace(r, cost=0.05) if r.tokens >= least and r.case == "qwen2.5-1.5b" else r
        for r in offload_measured.MEASURED
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(offload_measured, "MEASURED", costly)
        assert not offload_measured.within_from(least)
        assert "not within 3% of the step on every measured case" in offload_probe.auto_reason("cuda", least)
        # a case never measured at that size does not count as within it
        mp.setattr(offload_measured, "MEASURED", tuple(r for r in costly if r.case != "qwen2.5-1.5b"))
        assert not offload_measured.within_from(least)


def test_the_threshold_is_the_smallest_measured_size_every_case_stays_within():
    sizes = sorted({r.tokens for r in offload_measured.MEASURED})
    smaller = [t for t in sizes if t < offload_measured.AUTO_MIN_TOKENS]
    assert smaller and not any(offload_measured.within_from(t) for t in smaller)  # not lower than measured


@pytest.mark.parametrize(("least", "moved"), [(BATCH * LENGTH, True), (BATCH * LENGTH + 1, False)])
def test_auto_mode_leaves_shorter_micro_batches_as_stock_checkpointing(least, moved, tmp_path, monkeypatch):
    """Auto mode where it applies (as on CUDA): the planned threshold reaches the hooks; micro-batches below it keep
    stock checkpointing (``short``), the others move; training is stock's either way."""
    monkeypatch.setattr(offload_probe, "auto_reason", lambda device, tokens=None, processes=1: None)
    monkeypatch.setattr(offload_measured, "AUTO_MIN_TOKENS", least)
    stock = run(tiny, tmp_path, None, **checkpointed())
    ours = run(tiny, tmp_path, {"offload_checkpoints": None}, **checkpointed())
    assert_same_run(stock, ours)
    outcome = ours[2].leantrain_report["offload_checkpoints"]
    assert outcome.status is Status.APPLIED and f"at least {least} tokens" in outcome.detail, outcome
    live = stats(ours[2])
    assert (live.packed, live.short) == ((LAYERS * 3, 0) if moved else (0, LAYERS * 3))


def test_auto_mode_reads_the_processes_on_the_host(tmp_path, monkeypatch):
    trainer = trainer_for(tiny(), tmp_path, **checkpointed())
    seen = []
    monkeypatch.setattr(offload_probe, "auto_reason", lambda device, tokens=None, processes=1: seen.append(processes))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    offload_probe.probe(trainer, _context(trainer))
    assert seen == [4]


def test_on_request_every_micro_batch_moves(tmp_path):
    trainer = trainer_for(tiny(), tmp_path, **checkpointed())
    plan = offload_probe.probe(trainer, _context(trainer, offload_checkpoints=True)).plan
    assert plan.min_tokens == 0 and "auto mode moves" not in offload_probe.describe(plan)
    plan = offload_probe.probe(trainer, _context(trainer)).plan
    assert plan.min_tokens == offload_measured.AUTO_MIN_TOKENS


def test_checkpointing_off_is_said(tmp_path):
    with pytest.raises(NotReadyError, match="activation checkpointing is off"):
        leantrain.patch_trainer(trainer_for(tiny(), tmp_path), strict=True, **only("offload_checkpoints"))


def test_transformers_own_offload_is_not_doubled(tmp_path):
    trainer = trainer_for(tiny(), tmp_path, **checkpointed())
    for name in ("activation_checkpointing_kwargs", "gradient_checkpointing_kwargs"):
        if hasattr(trainer.args, name):
            setattr(trainer.args, name, {"use_reentrant": False, "offload": True})
    with pytest.raises(NotReadyError, match="transformers' own offload is on"):
        leantrain.patch_trainer(trainer, strict=True, **only("offload_checkpoints"))


def test_a_host_budget_below_one_token_is_refused(tmp_path):
    trainer = trainer_for(tiny(), tmp_path, **checkpointed())
    with pytest.raises(NotReadyError, match="holds less than one token"):
        leantrain.patch_trainer(
            trainer, strict=True, offload_checkpoints_max_host_gib=1e-9, **only("offload_checkpoints")
        )


def test_the_report_gives_the_bytes_kept_off_the_device(tmp_path, monkeypatch):
    """A micro-batch size and sequence length the trainer is told of give the bytes a step moves off the device."""
    trainer = trainer_for(tiny(), tmp_path, **checkpointed())
    monkeypatch.setattr(trainer.args, "max_length", 2048, raising=False)
    plan = dataclasses.replace(offload_probe.probe(trainer, _context(trainer)).plan, device="cuda")  # as on a GPU
    assert plan.bytes_per_token == HIDDEN * 4 and plan.tokens_per_micro_batch == BATCH * 2048
    detail = offload_probe.describe(plan)
    kept = (LAYERS - 1) * BATCH * 2048 * HIDDEN * 4  # 2 MiB
    assert f"about {kept // 2**20} MiB kept off the device" in detail, detail
    assert "host memory bounded at" in detail and "half of the" in detail


def _context(trainer, **options):
    from leantrain.config import resolve_config
    from leantrain.fallback import RuntimeFallback
    from leantrain.optimization import PatchContext

    return PatchContext(resolve_config(options, {}), "trainer", RuntimeFallback("offload_checkpoints", False))


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_grpo_samples_and_trains_as_stock_checkpointing(lora, tmp_path):
    """GRPO turns checkpointing off around generation and on for the loss: the same completions, losses and weights
    as stock checkpointing (the hooks never run during generation: no gradients there)."""
    pytest.importorskip("trl")
    from testkit import generation

    model_dir = generation.save_tiny(tmp_path / "model")
    runs = []
    for patch in (None, {"offload_checkpoints": True}):
        completions: list[str] = []
        trainer = generation.trainer(
            model_dir, tmp_path / "out", lora=lora, record=completions, gradient_checkpointing=True
        )
        if patch is not None:
            leantrain.patch_trainer(trainer, **{**only("offload_checkpoints"), **patch})
        trainer.train()
        runs.append((completions, generation.losses(trainer), generation.trainable(trainer), trainer))
    (stock_completions, stock_losses, stock_weights, _), (completions, losses, weights, ours) = runs
    assert completions == stock_completions and losses == stock_losses
    assert all(torch.equal(weights[name], w) for name, w in stock_weights.items())
    assert stats(ours).packed > 0 and ours.leantrain_report["offload_checkpoints"].status is Status.APPLIED
