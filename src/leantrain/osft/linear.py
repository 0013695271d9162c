"""The factored linear layer: W = U_high·diag(S_high)·V_high + U_low·diag(S_low)·V_low, top part frozen."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn


def is_conv1d(module: nn.Module) -> bool:
    """GPT-2's ``Conv1D`` (weight stored transposed, (in, out)); checked by name so transformers stays lazy."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers.")


def high_rank(n: int, m: int, unfrozen_rank_ratio: float) -> int:
    """k_high = floor(min(N, M)·(1 − ratio)); ratio ∈ (0, 1], so at least one direction trains."""
    if not 0.0 < unfrozen_rank_ratio <= 1.0:
        raise ValueError(f"osft_unfrozen_rank_ratio must be in (0, 1], got {unfrozen_rank_ratio!r}")
    return math.floor(min(n, m) * (1.0 - unfrozen_rank_ratio))


def thin_svd(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD of an fp32 matrix with factors orthonormal to fp32 rounding.

    On CUDA the default driver (gesvdj, Jacobi with a loose tolerance) leaves U and V about 1e-3 from orthonormal at
    2048x2048 (H100, 2026-11-23: spectral defect 1.2e-3, fp64 7e-8), far more than a frozen OSFT subspace can
    afford. gesvda was as accurate as fp64 there and 12x faster (31 vs 375 ms at 8192x2048), but it is only
    reliable on well-conditioned inputs, so its factors are checked in fp64 and fp64 runs where they fail.
    """
    if w.device.type != "cuda":
        return torch.linalg.svd(w, full_matrices=False)  # LAPACK gesdd: backward stable
    try:
        u, s, vh = torch.linalg.svd(w, full_matrices=False, driver="gesvda")
        if _accurate(w, u, s, vh):
            return u, s, vh
    except RuntimeError:  # gesvda's own convergence failure: the fp64 path below
        pass
    u, s, vh = torch.linalg.svd(w.double(), full_matrices=False)
    return u.float(), s.float(), vh.float()


def _accurate(w: torch.Tensor, u: torch.Tensor, s: torch.Tensor, vh: torch.Tensor) -> bool:
    """Orthonormal factors and reconstruction to 8·u32·sqrt(k), measured in fp64 (immune to TF32 settings)."""
    k = s.numel()
    tol = 8 * torch.finfo(torch.float32).eps / 2 * math.sqrt(k)
    u64, vh64 = u.double(), vh.double()
    eye = torch.eye(k, dtype=torch.float64, device=w.device)
    defect = torch.maximum((u64.t() @ u64 - eye).abs().max(), (vh64 @ vh64.t() - eye).abs().max())
    w64 = w.double()
    error = ((u64 * s.double()) @ vh64 - w64).norm() / w64.norm().clamp_min(1e-300)
    return bool(defect <= tol) and bool(error <= tol) and bool(torch.isfinite(s).all())


FACTORS = ("U_high", "S_high", "V_high", "U_low", "S_low", "V_low")


@torch.no_grad()
def rebuild(factors: Mapping[str, torch.Tensor], dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    """Dense weight from the six factors, computed in fp32, in the nn.Linear (or, transposed, Conv1D) layout.
    Sharded (DTensor) factors are gathered: a collective, every rank calls it."""
    f = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).float() for k, v in factors.items()}
    w = torch.mm(f["U_low"] * f["S_low"], f["V_low"])
    w.addmm_(f["U_high"] * f["S_high"], f["V_high"])
    return (w.t() if transposed else w).contiguous().to(dtype)


class OSFTLinear(nn.Module):
    """A linear layer held as its thin SVD; the top ``k_high`` singular triplets are frozen.

    ``U_high``/``S_high``/``V_high`` are parameters with ``requires_grad=False`` (so FSDP2 shards them),
    ``U_low``/``S_low``/``V_low`` train. ``bias`` is the source module's own parameter (shared, not copied).
    The forward runs on a 2-D view: ``y = (x V_highᵀ)(U_high S_high)ᵀ + b``, then one in-place
    ``addmm_`` adds ``(x V_lowᵀ)(U_low S_low)ᵀ``; no dense weight is formed.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        k_high: int,
        *,
        bias: nn.Parameter | None = None,
        transposed: bool = False,
        weight_dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        rank = min(in_features, out_features)
        if not 0 <= k_high < rank:
            raise ValueError(f"k_high must be in [0, {rank}), got {k_high}")
        self.in_features, self.out_features, self.k_high = in_features, out_features, k_high
        self.transposed = transposed  # the source was a Conv1D: export W transposed
        self.weight_dtype = weight_dtype  # dtype of the dense weight on export
        k_low = rank - k_high
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        frozen = lambda *shape: nn.Parameter(torch.empty(*shape, **kw), requires_grad=False)  # noqa: E731
        self.U_high = frozen(out_features, k_high)
        self.S_high = frozen(k_high)
        self.V_high = frozen(k_high, in_features)
        self.U_low = nn.Parameter(torch.empty(out_features, k_low, **kw))
        self.S_low = nn.Parameter(torch.empty(k_low, **kw))
        self.V_low = nn.Parameter(torch.empty(k_low, in_features, **kw))
        self.bias = bias
        self._source: list[nn.Module] = []  # the module this replaced (a list: not registered as a submodule)

    @property
    def k_low(self) -> int:
        return self.S_low.shape[0]

    @classmethod
    @torch.no_grad()
    def from_module(cls, module: nn.Module, unfrozen_rank_ratio: float) -> tuple[OSFTLinear, float]:
        """Factor an ``nn.Linear`` or GPT-2 ``Conv1D``: thin SVD in fp32 on the weight's device, factors cast to
        the weight's dtype. Returns the layer and the relative Frobenius reconstruction error of the cast factors."""
        weight = module.weight
        w = weight.detach().float()
        if is_conv1d(module):
            w = w.t()
        n, m = w.shape
        k_high = high_rank(n, m, unfrozen_rank_ratio)
        u, s, vh = thin_svd(w)
        layer = cls(
            m,
            n,
            k_high,
            bias=getattr(module, "bias", None),
            transposed=is_conv1d(module),
            weight_dtype=weight.dtype,
            device=weight.device,
            dtype=weight.dtype,
        )
        for name, value in (
            ("U_high", u[:, :k_high]),
            ("S_high", s[:k_high]),
            ("V_high", vh[:k_high]),
            ("U_low", u[:, k_high:]),
            ("S_low", s[k_high:]),
            ("V_low", vh[k_high:]),
        ):
            getattr(layer, name).copy_(value)
        error = (layer.dense_weight(torch.float32) - w).norm() / w.norm().clamp_min(1e-30)
        layer._source.append(module)
        return layer, float(error)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        h = torch.mm(x2, self.V_high.t())
        dt = h.dtype  # under autocast the mm output dtype is the autocast dtype; the in-place addmm_ needs one
        u_high = (self.U_high * self.S_high).to(dt)  # scale U (N·k), not the activations (T·k)
        if self.bias is not None:
            y = torch.addmm(self.bias.to(dt), h, u_high.t())
        else:
            y = torch.mm(h, u_high.t())
        g = torch.mm(x2, self.V_low.t()).to(dt)
        y.addmm_(g, (self.U_low * self.S_low).to(dt).t())
        return y.view(*shape[:-1], self.out_features)

    @torch.no_grad()
    def dense_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The (out, in) weight rebuilt in fp32 (full tensors if sharded), cast to ``dtype`` (default: source)."""
        return rebuild({n: getattr(self, n) for n in FACTORS}, dtype or self.weight_dtype, transposed=False)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, k_high={self.k_high}, "
            f"k_low={self.k_low}, bias={self.bias is not None}{', from Conv1D' if self.transposed else ''}"
        )


def dense_module(layer: OSFTLinear) -> nn.Module:
    """Write the merged weight back into the source module (same object) or build a new Linear / Conv1D."""
    weight = layer.dense_weight()
    if layer.transposed:
        weight = weight.t()
    weight = weight.contiguous()
    if layer._source:
        module = layer._source[0]
        module.weight.data = weight
        if layer.bias is not None:
            module.bias = layer.bias
        return module
    if layer.transposed:
        from transformers.pytorch_utils import Conv1D

        module = Conv1D(layer.out_features, layer.in_features)
    else:
        module = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
    module.to(device=weight.device, dtype=weight.dtype)
    module.weight.data = weight
    if layer.bias is not None:
        module.bias = layer.bias
    return module
