"""Stand-in rank entries for ``test_spawn_harness``: rank 0 dies by SIGABRT before or after writing its results
(a helper module, so that ``torch.multiprocessing.spawn``'s fresh processes can import them by name)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import _trainer_worker as worker
import torch


def write_results(rank: int, cases: list[str], out: Path) -> None:
    for case in cases:
        worker.save_atomically({"case": case, "rank": rank}, out / f"{case}_rank{rank}.pt")


def abort_after_results(rank: int, world: int, port: int, engine: str, cases: list[str], out: str) -> None:
    root = Path(out)
    worker.log_stderr(worker.rank_log(root, rank))
    write_results(rank, cases, root)
    if rank == 0:
        wait_for_results(world, cases, root)  # as run()'s closing barrier: every rank has written before rank 0 ends
        print("about to abort in the exit", file=sys.stderr, flush=True)
        os.abort()


def wait_for_results(world: int, cases: list[str], out: Path, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    files = [out / f"{case}_rank{r}.pt" for case in cases for r in range(world)]
    while not all(f.exists() for f in files):
        if time.monotonic() > deadline:
            raise TimeoutError(f"results never written: {[f.name for f in files if not f.exists()]}")
        time.sleep(0.01)


def abort_before_results(rank: int, world: int, port: int, engine: str, cases: list[str], out: str) -> None:
    root = Path(out)
    worker.log_stderr(worker.rank_log(root, rank))
    if rank == 0:
        torch.empty(0)  # the stack faulthandler prints is this function's
        os.abort()
    write_results(rank, cases, root)
