"""Why a probe must decline (or re-bind per replica) under ``nn.DataParallel``, checked on CPU without GPUs.

DataParallel copies every module per forward with ``Module._replicate_for_data_parallel`` (a shallow copy of
``__dict__``) and broadcasts parameters onto the copies. A forward patched on the instance with leantrain's
``Undo.wrap_method`` is copied along, still closing over the ORIGINAL module: a replica computes with the original's
parameters (on ``device_ids[0]``), not its own. Forward hooks are one dict shared by every replica. If torch ever
re-binds instance attributes per replica, these tests fail and the DataParallel rule can be revisited."""

from __future__ import annotations

import torch
from torch import nn

from leantrain.undo import Undo


def _replica_with_own_weight(module: nn.Linear) -> nn.Linear:
    """What replicate() does for one device: a shallow copy whose parameter is a distinct tensor."""
    replica = module._replicate_for_data_parallel()
    replica.weight = module.weight.detach() * 2  # stands for the broadcast copy on another device
    replica.bias = module.bias.detach()
    return replica


def test_instance_forward_patch_stays_bound_to_the_original():
    layer = nn.Linear(4, 3)
    undo = Undo()
    undo.wrap_method(layer, "forward", lambda original: lambda x: original(x))
    replica = _replica_with_own_weight(layer)
    x = torch.randn(2, 4)
    assert replica.forward is layer.forward  # the same closure object, copied with __dict__
    assert torch.equal(replica(x), layer(x))  # computed with the original's weight, not the replica's
    assert not torch.equal(nn.Linear.forward(replica, x), layer(x))  # what the replica should have computed
    undo()


def test_forward_hooks_are_shared_by_every_replica():
    layer = nn.Linear(4, 3)
    seen: list[int] = []
    layer.register_forward_hook(lambda module, args, out: seen.append(id(module)))
    replica = _replica_with_own_weight(layer)
    replica(torch.randn(2, 4))
    layer(torch.randn(2, 4))
    assert replica._forward_hooks is layer._forward_hooks and seen == [id(replica), id(layer)]


# ------------------------------------------------------------------------------- the probes that follow from this
def _as_if_two_gpus(trainer) -> None:
    """What TrainingArguments reports in one process that sees two GPUs (Trainer then wraps in DataParallel)."""
    trainer.args._n_gpu = 2
    assert trainer.args.parallel_mode.value == "not_distributed"


def test_cggr_and_moe4bit_decline_under_data_parallel(tmp_path):
    """Both patch module instances (the router hook, the experts forward): required, they raise naming DataParallel;
    in auto mode the report says why. OSFT replaces modules (replicated with their own factors): it is not refused."""
    import pytest

    import leantrain
    from leantrain import NotReadyError, Status
    from tests._moe4bit_model import make_model, make_trainer
    from tests.unit._fakes import tiny_trainer

    sft = tiny_trainer(tmp_path / "cggr")
    _as_if_two_gpus(sft)
    with pytest.raises(NotReadyError, match=r"cggr is required but not ready: nn.DataParallel \(one process, 2 GPUs"):
        leantrain.patch_trainer(sft, cggr=True, environ={})
    moe = make_trainer(make_model("qwen3_moe", "stacked"), tmp_path / "moe")
    _as_if_two_gpus(moe)
    with pytest.raises(NotReadyError, match=r"moe4bit is required but not ready: nn.DataParallel.*launch one process"):
        leantrain.patch_trainer(moe, moe4bit=True, environ={})
    # auto mode: the tiny MoE on CPU is not measured faster, so the report gives that and what would block moe4bit=True
    reasons = leantrain.patch_trainer(moe, environ={})["moe4bit"].reasons
    assert "not measured on cpu" in reasons[0] and "moe4bit=True would not apply either: nn.DataParallel" in reasons[0]
    leantrain.unpatch_trainer(moe)
    moe.args._n_gpu = 1
    assert leantrain.patch_trainer(moe, moe4bit=True, environ={})["moe4bit"].status is Status.APPLIED  # one GPU
    leantrain.unpatch_trainer(moe)
