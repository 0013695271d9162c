"""Worker for the 2-process OSFT tests (gloo, CPU): train a few AdamW steps under FSDP2 / DDP and report full
parameters, layouts and orthogonality; the same code with ``world == 1`` is the single-process reference."""

from __future__ import annotations

import os
import socket
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from leantrain.osft import Projector, convert, frozen_overlap, fully_shard, osft_layers
from leantrain.osft.ops import layout


STEPS = 4
GLOBAL_BATCH = 4


class Block(nn.Module):
    def __init__(self, d: int = 48) -> None:
        super().__init__()
        self.attn_in, self.attn_kv, self.attn_out = nn.Linear(d, d), nn.Linear(d, d // 2), nn.Linear(d // 2, d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        # in_features 23 (odd): cannot go on Shard(1) over 2 ranks, so the model mixes both V layouts
        self.narrow, self.back = nn.Linear(d, 23), nn.Linear(23, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn_out(torch.tanh(self.attn_kv(torch.tanh(self.attn_in(h)))))
        h = h + self.down(torch.tanh(self.up(h)))
        return h + self.back(torch.tanh(self.narrow(h)))


class ToyLM(nn.Module):
    """Pure torch (spawned workers skip importing transformers). At ratio 0.3, k_high is 33 for the 48-wide and
    96-wide targets: uneven Shard(0) over 2 ranks."""

    def __init__(self, vocab: int = 128, d: int = 48, layers: int = 2) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.blocks:
            h = block(h)
        logits = self.head(h[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1))


TARGETS = [r"re:blocks\.\d+\.\w+"]


def batches(rank: int, world: int) -> list[torch.Tensor]:
    """Each step's global batch, this rank's rows (equal token counts, so mean losses average exactly)."""
    g = torch.Generator().manual_seed(123)
    per = GLOBAL_BATCH // world
    steps = [torch.randint(0, 128, (GLOBAL_BATCH, 10), generator=g) for _ in range(STEPS)]
    return [batch[rank * per : (rank + 1) * per] for batch in steps]


def wrap(model: nn.Module, mode: str) -> nn.Module:
    if mode == "single":
        return model
    if mode == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    shard = fully_shard if mode == "fsdp_shard1" else torch_fully_shard  # leantrain's V-on-dim-1 vs FSDP default
    for block in model.blocks:
        shard(block, mesh=mesh)
    shard(model, mesh=mesh)
    return model


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def train(mode: str, ratio: float = 0.3, cache_v_high: bool = False) -> dict[str, Any]:
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model = ToyLM()
    conversion = convert(model, unfrozen_rank_ratio=ratio, targets=TARGETS, progress=False)
    factors0 = {n: {f: full(getattr(m, f)) for f in ("U_high", "V_high")} for n, m in conversion.layers.items()}
    wrapped = wrap(model, mode)
    layers = list(osft_layers(model).values())
    projector = Projector(layers, cache_v_high=cache_v_high)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for batch in batches(rank, world):
        wrapped(batch).backward()
        projector.project_gradients()
        optimizer.step()
        projector.project_parameters()
        optimizer.zero_grad()
    names = {n.removeprefix("module."): p for n, p in wrapped.named_parameters()}
    return {
        "params": {n: full(p) for n, p in names.items()},
        "factors0": factors0,
        "v_layout": {n: layout(layer.V_high).dim for n, layer in osft_layers(model).items()},
        "u_layout": {n: layout(layer.U_high).dim for n, layer in osft_layers(model).items()},
        "overlap": max(frozen_overlap(layer) for layer in layers),
        "collectives": projector.uses_collectives(),
        "gathers": projector.gathers,
        "regathers": regather_after_change(projector, layers) if cache_v_high else None,
    }


def regather_after_change(projector: Projector, layers: list) -> tuple[int, int]:
    """All-gathers issued by one more projection with V_high unchanged, then after an in-place edit of one V_high on
    every rank (what a checkpoint load does): the cache is reused, then invalidated."""
    before = projector.gathers
    projector.project_parameters()
    unchanged = projector.gathers - before
    layers[0].V_high.to_local().mul_(1.0)  # same values, a new version of the storage
    projector.project_parameters()
    return unchanged, projector.gathers - before - unchanged


def naive_vs_leantrain_shard0() -> dict[str, float]:
    """One backward under FSDP2's default Shard(0); the V coefficient of a 48×48 target (k 24/24: equal shard sizes,
    so the naive all-reduce does not hang) computed naively (mini_trainer PR #75: all-reduce of the local diagonal
    block) and by leantrain (gather V_high). Returns max |dV_projected · V_highᵀ| / max |dV| for both."""
    from torch.distributed.tensor import DTensor, Shard

    model = ToyLM()
    convert(model, unfrozen_rank_ratio=0.5, targets=TARGETS, progress=False)
    wrap(model, "fsdp_default")
    layer = model.blocks[0].attn_in
    model(batches(dist.get_rank(), dist.get_world_size())[0]).backward()
    dv, v_high = layer.V_low.grad, layer.V_high
    local_dv, local_vh = dv.to_local().clone(), v_high.to_local()
    coeff = local_dv @ local_vh.t()
    dist.all_reduce(coeff)
    naive = DTensor.from_local(local_dv - coeff @ local_vh, dv.device_mesh, [Shard(0)]).full_tensor()
    scale = dv.full_tensor().abs().max()
    Projector([layer]).project_gradients()
    ours = layer.V_low.grad.full_tensor()
    vh = v_high.full_tensor()
    return {
        "naive": float((naive @ vh.t()).abs().max() / scale),
        "leantrain": float((ours @ vh.t()).abs().max() / scale),
    }


SCENARIOS = {
    "fsdp": lambda: {
        "fsdp_shard1": train("fsdp_shard1"),
        "fsdp_default": train("fsdp_default"),
        "fsdp_default_cached": train("fsdp_default", cache_v_high=True),
        "naive": naive_vs_leantrain_shard0(),
    },
    "ddp": lambda: {"ddp": train("ddp")},
}


def run(rank: int, world: int, port: int, scenario: str, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    result = SCENARIOS[scenario]()
    if rank == 0:
        torch.save(result, out)
    # leave together (as _trainer_worker.end_process_group): a rank that exits while its peer's gloo connections are
    # open can make the peer's gloo thread throw on the closed socket and abort it
    dist.barrier()
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_two(entry: Callable[..., None], scenario: str, out: Path, *extra: Any) -> dict:
    """``entry(rank, 2, port, scenario, out, *extra)`` on two processes; rank 0's results from ``out``. A rank killed
    by a signal fails unless the results were written: then the crash was in the process's exit, after everything
    the tests compare (a warning, as the trainer harness reports it)."""
    import torch.multiprocessing as mp

    try:
        mp.spawn(entry, args=(2, free_port(), scenario, str(out), *extra), nprocs=2, join=True)
    except mp.ProcessExitedException as died:
        if not out.exists():
            raise
        warnings.warn(f"a rank died after the results were written (in its exit): {died}", stacklevel=2)
    return torch.load(out, weights_only=False)
