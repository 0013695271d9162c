"""A multi-process launch (``torchrun``, ``accelerate launch``) run to its end, with the verdict
``_trainer_cases.spawn`` gives a ``torch.multiprocessing`` run: a launch that fails before every rank wrote its results
fails the test with the output's tail; one that fails after, in a rank's exit, is a warning. Gloo's threads outlive
``destroy_process_group`` while DeepSpeed or DDP still hold the group, and one that drops a tensor while the
interpreter shuts down aborts that rank ("terminate called without an active exception", pytorch/pytorch#190489),
after the run and after everything the test reads."""

from __future__ import annotations

import subprocess
import warnings
from pathlib import Path


def launch(command: list[str], results: list[Path], tail: int = 4000, **kwargs) -> subprocess.CompletedProcess:
    """Run ``command`` (``subprocess.run``'s ``kwargs``, text output captured) and check its exit as above;
    ``results`` are the files every rank writes when its run is done."""
    done = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if done.returncode == 0:
        return done
    log = (done.stdout + done.stderr)[-tail:]
    missing = [p.name for p in results if not p.exists()]
    if missing:
        raise AssertionError(f"exit {done.returncode}, results never written: {', '.join(missing)}\n{log}")
    message = f"a rank died after every result was written (in its exit): exit {done.returncode}\n{log}"
    warnings.warn(message, stacklevel=2)
    return done
