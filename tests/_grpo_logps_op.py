"""Inputs and the fp64 reference of the fused log-prob/entropy op, shared by its op and keep-logits tests.
(A helper module: a test module is never imported as one.)"""

from __future__ import annotations

import torch


N, H, V = 123, 48, 1001


def reference(h, w, targets, temperature=1.0, scale=1.0, softcap=None):
    """fp64 logp and entropy of softcap(scale·h·Wᵀ)/T; ignored targets give 0 (the op's convention)."""
    z = (h.double() @ w.double().T) * scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logp_all = torch.log_softmax(z / temperature, -1)
    valid = targets >= 0
    logp = logp_all.gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return torch.where(valid, logp, 0.0), torch.where(valid, entropy, 0.0)


def make_inputs(seed=0, n=N, v=V, h=H, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.4).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g)
    targets[:7] = -100  # padded / prompt rows
    targets[7], targets[8] = 0, v - 1  # vocab edges
    return hidden, weight, targets
