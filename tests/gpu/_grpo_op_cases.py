"""The fused log-prob op's CUDA cases and their fp64 reference with derived bounds, shared by the op and the
no-grad dispatch CUDA tests.
(A helper module: a test module is never imported as one.)"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


U32 = 2.0**-24
UNIT = {torch.float32: U32, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


@dataclass(frozen=True)
class Case:
    n: int
    v: int
    h: int
    dtype: torch.dtype
    temperature: float = 1.0
    softcap: float | None = None
    scale: float = 1.0
    trainable: bool = False
    entropy_grad: bool = False

    def __str__(self) -> str:
        head = "trainable" if self.trainable else "frozen"
        extra = f"-cap{self.softcap}" if self.softcap else ""
        extra += f"-s{self.scale}" if self.scale != 1.0 else ""
        extra += "-entgrad" if self.entropy_grad else ""
        return f"{self.n}x{self.v}x{self.h}-{str(self.dtype)[6:]}-T{self.temperature}{extra}-{head}"


@dataclass
class Reference:
    logp: torch.Tensor
    entropy: torch.Tensor
    grad_h: torch.Tensor
    grad_w: torch.Tensor | None
    logp_tile: torch.Tensor  # per-token bounds (see the module docstring), fp64
    logp_fold: torch.Tensor
    ent_tile: torch.Tensor
    ent_fold: torch.Tensor
    x_rms_max: float


def reference(case: Case, hidden, weight, targets, g_logp, g_ent, rows: int = 256) -> Reference:
    """fp64 values, gradients and error scales of the same (already rounded) inputs, in row chunks."""
    u = UNIT[case.dtype]
    k = abs(case.scale) / case.temperature
    w64 = weight.double()
    grad_h = torch.zeros(hidden.shape, device=hidden.device, dtype=torch.float64)
    grad_w = torch.zeros_like(w64) if case.trainable else None
    names = ("logp", "entropy", "logp_tile", "logp_fold", "ent_tile", "ent_fold", "x_rms")
    out = {n: torch.zeros(case.n, device=hidden.device, dtype=torch.float64) for n in names}
    for r0 in range(0, case.n, rows):
        sl = slice(r0, min(r0 + rows, case.n))
        h = hidden[sl].double()
        t = targets[sl]
        valid = t >= 0
        tc = t.clamp(min=0)[:, None]
        x = h @ w64.T
        y = x * case.scale
        if case.softcap is None:
            z, f = y / case.temperature, 1.0
        else:
            th = torch.tanh(y / case.softcap)
            z, f = th * (case.softcap / case.temperature), 1 - th * th
        log_z = torch.logsumexp(z, -1)
        p = torch.exp(z - log_z[:, None])
        z_y = z.gather(1, tc).squeeze(1)
        mu = (p * z).sum(-1)
        dev = (z - mu[:, None]).abs()
        xk = x.abs() * k
        x_rms = x.square().mean(-1).sqrt()
        gemm = 2 * 4 * U32 * math.sqrt(case.h) * k * x_rms
        fold = 4 * U32 * (log_z.abs() + z_y.abs() + math.log2(case.v))
        out["logp"][sl] = torch.where(valid, z_y - log_z, 0.0)
        out["entropy"][sl] = torch.where(valid, log_z - mu, 0.0)
        out["logp_tile"][sl] = u * (xk.gather(1, tc).squeeze(1) + (p * xk).sum(-1)) + gemm
        out["logp_fold"][sl] = fold
        out["ent_tile"][sl] = u * (p * xk * dev).sum(-1) + gemm * (p * dev).sum(-1)
        out["ent_fold"][sl] = 4 * U32 * (log_z.abs() + mu.abs() + math.log2(case.v))
        out["x_rms"][sl] = x_rms
        # dL/dz for L = Σ g_logp·logp (+ Σ g_ent·H), then through softcap/scale/T to dL/dx
        gl = torch.where(valid, g_logp[sl].double(), 0.0)
        grad_z = -p * gl[:, None]
        grad_z.scatter_add_(1, tc, gl[:, None])
        if case.entropy_grad:
            ge = torch.where(valid, g_ent[sl].double(), 0.0)
            grad_z -= ge[:, None] * p * (z - mu[:, None])
        grad_x = grad_z * f * (case.scale / case.temperature)
        grad_h[sl] = grad_x @ w64
        if grad_w is not None:
            grad_w += grad_x.T @ h
        del x, y, z, p, grad_z, grad_x, xk, dev
    return Reference(
        out["logp"], out["entropy"], grad_h, grad_w, out["logp_tile"], out["logp_fold"], out["ent_tile"],
        out["ent_fold"], out["x_rms"].max().item(),
    )  # fmt: skip
