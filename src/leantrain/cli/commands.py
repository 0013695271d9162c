"""Command line: `leantrain demo` (stock vs patched training on a tiny local model), `leantrain env`,
`leantrain run` (patch the trainers of an unmodified script, module or console script) and `leantrain compare`
(train a script stock and with leantrain, a few steps each, and say what it buys)."""

from __future__ import annotations

import argparse
import logging
import os
import platform
import sys
import warnings
from collections.abc import Mapping
from importlib import metadata


DEMO = "train a tiny local model stock vs patched and compare"
PACKAGES = ("torch", "transformers", "trl", "peft", "accelerate", "bitsandbytes", "cut-cross-entropy", "triton")


def env_report() -> str:
    """Versions, device, and each optimization's readiness on this machine: paste it into bug reports."""
    import torch

    from .. import __version__
    from ..optimization import registry

    lines = [f"leantrain {__version__}", f"python {platform.python_version()} ({platform.platform()})"]
    for name in PACKAGES:
        try:
            lines.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            lines.append(f"{name} not installed")
    from .._compat import untested

    lines += [f"untested: {note} (COMPATIBILITY.md)" for note in untested()]
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability(0)
        lines.append(f"device cuda: {torch.cuda.get_device_name(0)} (sm{cap[0]}{cap[1]}), CUDA {torch.version.cuda}")
    else:
        lines.append(f"device cpu: {torch.get_num_threads()} threads")
    lines.append("optimizations (readiness on this machine, before seeing a trainer):")
    states = {}
    for name, opt in registry().items():
        reasons = opt.check_environment()
        states[name] = "ready" if not reasons else "not ready: " + "; ".join(reasons)
    lines += _aligned(states)
    return "\n".join(lines)


def _aligned(states: Mapping[str, str]) -> list[str]:
    """One indented line per name, the states in one column after the longest name."""
    width = max(map(len, states), default=0)
    return [f"  {name:<{width}}  {state}" for name, state in states.items()]


def env_settings(environ: Mapping[str, str]) -> str:
    """The ``LEANTRAIN_*`` variables set, each with the value it parses to. Checked exactly as ``leantrain run`` and
    ``patch_trainer`` check them: an unknown name or a bad value raises the same error."""
    from ..config import LeantrainConfig, resolve_config

    cfg = resolve_config({}, environ)
    rows = [
        (f"{var}={environ[var]}", f.name, getattr(cfg.config, f.name), f.metadata["kind"])
        for f in LeantrainConfig.options()
        if (var := LeantrainConfig.env_name(f.name)) in environ
    ]
    if not rows:
        return "LEANTRAIN_* variables: none set (defaults apply)"
    width = max(len(row[0]) for row in rows)
    lines = [f"LEANTRAIN_* variables set ({len(rows)}), as patch_trainer reads them:"]
    for typed, name, value, kind in rows:
        shown = {None: "auto", True: "True (required)", False: "False (off)"}[value] if kind == "tristate" else value
        lines.append(f"  {typed:<{width}}  {name} = {shown!s}")
    if cfg.config.disable:
        lines.append("  the kill switch is on: every optimization off unless asked for in code or by a run flag")
    return "\n".join(lines)


# Third-party notices a user of the commands cannot act on, each by its source and its own words. Dropped in the
# commands' processes only (quiet_third_party, first thing in main: compare's runs and a followed launcher's children
# start through main too); a library user who calls patch_trainer keeps every warning and log record.
QUIET_LOGS = (
    # bitsandbytes' CPU backend, at import: the optional `kernels` package is missing for one AVX-512 kernel; it runs
    # its own CPU path
    ("bitsandbytes.backends.cpu.ops", "gemm_4bit_forward from kernels-community"),
    # DeepSpeed, which accelerate and transformers import whenever it is installed, on a machine without CUDA: the
    # run is on the CPU either way, and DeepSpeed is not what trains it
    ("DeepSpeed", "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect it."),
)
QUIET_WARNINGS = (
    # transformers renamed gradient checkpointing to activation checkpointing; TRL's configs default the old field
    # to True and its trainers call the old methods, so every TRL run warns whatever the script says
    (
        FutureWarning,
        r"`(is_)?gradient_checkpointing(_enable|_disable|_kwargs)?` is deprecated and will be removed in v6",
    ),
)


class _DropNotice(logging.Filter):
    """Drops a logger's records that contain ``words``; every other record passes."""

    def __init__(self, words: str) -> None:
        super().__init__()
        self.words = words

    def filter(self, record: logging.LogRecord) -> bool:
        return self.words not in record.getMessage()


def quiet_third_party() -> None:
    """Drop QUIET_LOGS and QUIET_WARNINGS in this process (idempotent). A logger's filter holds from before the
    library that logs is imported, so this runs before anything loads."""
    for name, words in QUIET_LOGS:
        target = logging.getLogger(name)
        if not any(isinstance(f, _DropNotice) and f.words == words for f in target.filters):
            target.addFilter(_DropNotice(words))
    for category, message in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)  # replaces an identical filter


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    quiet_third_party()
    if argv[:1] == ["run"]:  # its own parser: the target's arguments pass through untouched, --flags included
        from .launch import main as run_main

        return run_main(argv[1:])
    if argv[:1] == ["compare"]:  # the same: the target's arguments pass through untouched
        from .compare import main as compare_main

        return compare_main(argv[1:])
    if argv[:1] == ["demo"]:  # its own parser too: the demo's module loads torch, which the other commands' help skips
        from .demo import build_parser, run_demo

        run_demo(build_parser(argparse.ArgumentParser(prog="leantrain demo", description=DEMO)).parse_args(argv[1:]))
        return 0
    parser = argparse.ArgumentParser(prog="leantrain", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    sub.add_parser("demo", help=DEMO, add_help=False)
    sub.add_parser("env", help="versions, device, readiness of each optimization, and the LEANTRAIN_* variables set")
    sub.add_parser("run", help="run a script, -m module or console script with its trainers patched", add_help=False)
    sub.add_parser("compare", help="train a script a few steps stock and with leantrain: what it buys", add_help=False)
    args = parser.parse_args(argv)
    if args.command == "env":
        try:  # first, and exactly as `run` and patch_trainer would: a bad variable fails before anything loads
            settings = env_settings(os.environ)
        except (TypeError, ValueError) as error:
            print(f"leantrain env: error: {error}", file=sys.stderr)
            return 2
        print(env_report())
        print(settings)
        return 0
    if args.command is None:  # bare `leantrain`: say what there is; the demo trains for minutes and writes files
        parser.print_help()
        return 0
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
