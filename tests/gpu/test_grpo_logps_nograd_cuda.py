"""On CUDA: a no-grad fused_lm_head call that the measured rule sends to TRL's own head returns TRL's
output bitwise (it is TRL's forward), and the same call through leantrain's op stays within the op suite's per-token
bounds of it (tests/gpu/test_grpo_logps_op_cuda.py: tile and fold errors, each path's, from an fp64 reference of the
same hidden states); the real rule dispatches a measured vocabulary without counting labels.

Run: ``python3 -m pytest -q -m gpu tests/gpu/test_grpo_logps_nograd_cuda.py``. Dev-only:
``LEANTRAIN_TEST_DEVICE=cpu python -m pytest -q --noconftest tests/gpu/test_grpo_logps_nograd_cuda.py`` runs the
logic on CPU (TRL's and leantrain's torch paths; the real-rule test needs Triton and skips).
"""

from __future__ import annotations

import pytest
import torch

from tests.gpu._device import DEVICE, dev_fixture, needs_device  # noqa: E402, F401 (the "dev" fixture)


pytestmark = needs_device

trl = pytest.importorskip("trl")
pytest.importorskip("trl.kernels.chunked_logprob")

import leantrain  # noqa: E402
from leantrain.cli.tiny import tiny_model  # noqa: E402
from leantrain.grpo_logps import nograd  # noqa: E402
from leantrain.grpo_logps import patch as glue  # noqa: E402
from leantrain.grpo_logps import probe as logps_probe  # noqa: E402
from leantrain.lm_head import ops  # noqa: E402
from tests._grpo_logps_trainers import count_op_calls  # noqa: E402
from tests.gpu import _grpo_helpers as H  # noqa: E402
from tests.gpu._grpo_op_cases import Case, reference  # noqa: E402


TEMPERATURE = 0.7  # _grpo_helpers.make_trainer's


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return H.save_model(str(tmp_path_factory.mktemp("tiny_llama_nograd_cuda")))


def batch(device: torch.device) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (4, 40), generator=g)
    att = torch.ones_like(ids)
    att[1, :7] = 0
    labels = ids.masked_fill(att == 0, -100)
    labels[:, :-24] = -100
    labels[3] = -100  # nothing to score in one row
    return {k: v.to(device) for k, v in dict(input_ids=ids, attention_mask=att, labels=labels).items()}


def call(model, inputs: dict):
    with torch.no_grad():
        return model(**inputs, fused_lm_head=True)


def bounds(model, inputs: dict, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Per scored token: the op suite's logp (and entropy) error bound of one fp32 head from fp64, and the mask."""
    with torch.no_grad():
        hidden = model.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        hidden = hidden.last_hidden_state[:, :-1]
    labels = inputs["labels"][:, 1:]
    mask = labels != -100
    weight = model.get_output_embeddings().weight.detach()
    case = Case(int(mask.sum()), weight.shape[0], weight.shape[1], torch.float32, TEMPERATURE)
    zeros = torch.zeros(case.n, device=weight.device)
    ref = reference(case, hidden[mask].float(), weight.float(), labels[mask], zeros, zeros)
    return ref.logp_tile + ref.logp_fold, (ref.ent_tile + ref.ent_fold) if entropy else None, mask


def test_dispatch_is_trls_output_and_the_op_stays_within_bounds(dev, model_dir, tmp_path, monkeypatch):
    trainer = H.make_trainer(model_dir, tmp_path, use_cpu=dev.type == "cpu", beta=0.1, bf16=False)  # fp32 + ref
    models = {"policy": trainer.model, "ref": trainer.ref_model}
    inputs = batch(dev)
    stock = {name: call(m, inputs) for name, m in models.items()}
    leantrain.patch_trainer(trainer, grpo_logps=True)
    calls = count_op_calls(monkeypatch)

    monkeypatch.setattr(nograd, "trl_head_serves", lambda *args: True)
    for name, model in models.items():
        out = call(model, inputs)
        for field in ("log_probs", "entropy", "loss", "label_mask"):
            a, b = getattr(stock[name], field), getattr(out, field)
            assert (a is None and b is None) or torch.equal(a, b), (name, field)
    assert calls == []  # TRL's forward served both

    monkeypatch.setattr(nograd, "trl_head_serves", lambda *args: False)
    for name, model in models.items():
        out = call(model, inputs)
        entropy = name == "policy"  # TRL's reference head computes no entropy
        logp_bound, ent_bound, mask = bounds(model, inputs, entropy)
        # both heads are within their bound of the fp64 value: within twice of each other
        err = (out.log_probs - stock[name].log_probs)[mask].double().abs()
        assert (err <= 2 * logp_bound).all(), (name, (err / logp_bound).max().item())
        assert (out.log_probs[~mask] == 0).all()
        if entropy:
            ent_err = (out.entropy - stock[name].entropy)[mask].double().abs()
            assert (ent_err <= 2 * ent_bound).all(), (name, (ent_err / ent_bound).max().item())
        else:
            assert out.entropy is None
    assert calls == [ops.default_backend(dev)] * 2


def test_real_rule_dispatches_a_measured_regime(dev):
    """TRL's fused head on a one-layer model with a measured vocabulary (Llama-3's, at Qwen2.5-0.5B's width): the real
    rule sends its no-grad call to TRL's forward, bitwise (it reads the head's vocabulary, never the labels), and
    never a call that wants a gradient."""
    if ops.default_backend(dev) != "triton":
        pytest.skip("the rule covers the Triton backend only")
    from trl.trainer.utils import add_fused_lm_head

    v, h = nograd.MEASURED_V[0], 896
    with torch.device(dev):
        model = tiny_model("llama", vocab_size=v, hidden=h, layers=1, dtype=torch.bfloat16)
    add_fused_lm_head(model, TEMPERATURE, outputs=("log_probs", "entropy"))
    settings = logps_probe.trl_head_settings(model)
    assert not isinstance(settings, str), settings

    def op(*args):
        raise AssertionError("leantrain's op ran for a dispatched call")

    call = glue.FusedCall(settings, op, lambda: False, trl_head=True)
    stock = model.forward
    forward = glue.make_forward(model, call, None, stock)
    inputs = batch(dev)
    with torch.no_grad():
        assert glue.uses_trl_head(model, call)
        ours, ref = forward(**inputs, fused_lm_head=True), stock(**inputs, fused_lm_head=True)
    assert torch.equal(ours.log_probs, ref.log_probs) and torch.equal(ours.entropy, ref.entropy)
    assert not glue.uses_trl_head(model, call)  # grad mode
