"""Token difficulty scores from a decoder layer's hidden state: final norm -> LM head -> logit scale / softcap ->
score, in fp32, in token chunks (the full [B, T, V] logits never exist). Higher score = harder = kept first.

- ``entropy``: entropy of the next-token distribution.
- ``loss``: cross-entropy of the actual next token.
- ``margin``: minus the top-1/top-2 probability margin (a small margin is an uncertain token).
- ``combined``: z-scored entropy plus z-scored (minus) margin, statistics over the valid positions of each row.

``entropy`` and ``loss`` go through TRL's fused chunked log-prob kernel (Triton on CUDA, torch tiles elsewhere) when
the head is a plain ``nn.Linear``; the other scores, and heads wrapped by PEFT or quantization, use a torch path that
calls the head module itself in chunks.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import CGGR_SCORINGS
from ..models import DecoderParts, text_config


SCORINGS = CGGR_SCORINGS
_CHUNK_ELEMENTS = 1 << 25  # logits per torch-path chunk: 128 MiB of fp32 per temporary
_VOCAB_TILE = 8192  # vocabulary width of one fused-kernel tile


def _norm(parts: DecoderParts, hidden: torch.Tensor) -> torch.Tensor:
    return parts.final_norm(hidden) if parts.final_norm is not None else hidden


def _transform(logits: torch.Tensor, parts: DecoderParts) -> torch.Tensor:
    z = logits.float()
    if parts.logit_scale != 1.0:
        z = z * parts.logit_scale
    if parts.softcap is not None:
        z = torch.tanh(z / parts.softcap) * parts.softcap
    return z


def _fused_ok(parts: DecoderParts, scoring: str) -> bool:
    return scoring in ("entropy", "loss") and type(parts.lm_head) is nn.Linear


def _fused_scores(parts: DecoderParts, hidden: torch.Tensor, targets: torch.Tensor, scoring: str) -> torch.Tensor:
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction

    head = parts.lm_head
    outputs = ("entropy",) if scoring == "entropy" else ()
    log_probs, entropy, *_ = ChunkedLogProbFunction.apply(
        _norm(parts, hidden),
        head.weight,
        head.bias,
        targets,
        1.0,
        _VOCAB_TILE,
        parts.softcap,
        parts.logit_scale,
        outputs,
    )
    return entropy if scoring == "entropy" else -log_probs


def _chunk_scores(parts: DecoderParts, hidden: torch.Tensor, targets: torch.Tensor, scoring: str) -> torch.Tensor:
    """[n] scores of one chunk of [n, H] hidden rows."""
    z = _transform(parts.lm_head(_norm(parts, hidden)), parts)
    lse = torch.logsumexp(z, dim=-1)
    if scoring == "loss":
        return lse - z.gather(1, targets[:, None]).squeeze(1)
    probs = torch.exp(z - lse[:, None])
    entropy = lse - (probs * z).sum(-1)
    if scoring == "entropy":
        return entropy
    top2 = probs.topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    return -margin if scoring == "margin" else torch.stack((entropy, margin), dim=-1)


def _zscore(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Per-row z-score over the valid positions (population std, floored so a constant row gives zeros)."""
    weight = valid.float()
    count = weight.sum(dim=1, keepdim=True).clamp(min=1.0)
    mean = (values * weight).sum(dim=1, keepdim=True) / count
    var = ((values - mean).square() * weight).sum(dim=1, keepdim=True) / count
    return (values - mean) / var.sqrt().clamp(min=1e-6)


@torch.no_grad()
def score_tokens(
    parts: DecoderParts, hidden: torch.Tensor, targets: torch.Tensor, scoring: str, chunk_tokens: int | None = None
) -> torch.Tensor:
    """fp32 scores [B, T'] for hidden positions ``0..T'-1`` (``T' = targets.shape[1]``; targets aligned to them)."""
    if scoring not in SCORINGS or scoring == "random":
        raise ValueError(f"cannot score with {scoring!r}")
    rows, width = targets.shape
    valid = targets != -100
    flat_hidden = hidden[:, :width].detach().reshape(rows * width, -1)
    flat_targets = targets.clamp(min=0).reshape(-1)
    if _fused_ok(parts, scoring):
        return _fused_scores(parts, flat_hidden, flat_targets, scoring).view(rows, width).float()
    vocab = parts.lm_head.weight.shape[0] if hasattr(parts.lm_head, "weight") else 1 << 17
    step = chunk_tokens or max(1, _CHUNK_ELEMENTS // vocab)
    pieces = [
        _chunk_scores(parts, flat_hidden[start : start + step], flat_targets[start : start + step], scoring)
        for start in range(0, flat_hidden.shape[0], step)
    ]
    out = torch.cat(pieces).view(rows, width, -1) if pieces else hidden.new_zeros(rows, width, 2, dtype=torch.float)
    if scoring != "combined":
        return out.view(rows, width)
    return _zscore(out[..., 0], valid) - _zscore(out[..., 1], valid)


def random_scores(shape: tuple[int, int], generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """Uniform scores for the random-selection control, from a private generator (the training RNG is untouched)."""
    return torch.rand(shape, generator=generator, device=device)


def head_share(config) -> float:
    """Estimated share of the LM head in per-token forward matmul MACs (attention-score term left out)."""
    text = text_config(config)
    hidden = getattr(text, "hidden_size", None) or getattr(text, "n_embd", None)
    layers = getattr(text, "num_hidden_layers", None) or getattr(text, "n_layer", None)
    vocab = text.vocab_size
    heads = getattr(text, "num_attention_heads", None) or getattr(text, "n_head", None)
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    attention = 2 * hidden * heads * head_dim + 2 * hidden * kv_heads * head_dim
    top_k = getattr(text, "num_experts_per_tok", None)
    if top_k:  # MoE: the routed experts' matmuls (gpt-oss keeps the per-expert width in intermediate_size)
        per_expert = getattr(text, "moe_intermediate_size", None) or text.intermediate_size
        mlp = top_k * 3 * hidden * per_expert
    elif getattr(text, "model_type", "") in ("gpt2", "gpt_neox"):
        inner = getattr(text, "n_inner", None) or getattr(text, "intermediate_size", None) or 4 * hidden
        mlp = 2 * hidden * inner
    else:
        inner = getattr(text, "intermediate_size", None) or 4 * hidden
        mlp = 3 * hidden * inner
    head = vocab * hidden
    return head / (head + layers * (attention + mlp))
