"""``leantrain run``: patch every Trainer that an unmodified training script, module or console script builds.

``leantrain run [--cggr/--no-cggr ...] [--strict] [--opt NAME=VALUE ...] (FILE | -m MODULE | SCRIPT) [ARGS ...]``

For the duration of the run only, ``transformers.Trainer.train`` is wrapped at class level (TRL trainers subclass
it): the first ``train()`` of each trainer calls :func:`leantrain.patch_trainer` with the command line's options,
before the optimizer exists, then trains. ``Trainer.__init__`` is wrapped too, only to count the trainers built:
when nothing was patched, the run says why (no trainer built, or ``train()`` never ran). Both wrappers are removed
when the target returns. Those are the only class-level patches leantrain makes, and only in a process that asked
for them with ``run``; importing leantrain changes nothing. The command line's options are their own source,
``cli``, for every ``patch_trainer`` call in the run: a keyword in code > the command line > ``LEANTRAIN_*``
environment > default; a flag that asks for an optimization is an explicit request, like a keyword, so it overrides
``LEANTRAIN_DISABLE=1``.

A target that starts ``accelerate launch`` in-process (the ``trl`` CLI does, for ``trl sft`` and the other training
commands) is followed: its children run as ``python -m leantrain run <the same options> <script> ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import runpy
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from importlib.util import find_spec
from typing import Any

from ..config import OPTIMIZATIONS, resolve_config
from . import _keep, _measure


USAGE = "leantrain run [options] (FILE | -m MODULE | CONSOLE_SCRIPT) [ARGS ...]"
EPILOG = (
    "Everything after the target goes to the target untouched. Options resolve as: keywords the target passes to "
    "patch_trainer itself, then the command line, then LEANTRAIN_* environment variables, then defaults; a flag "
    "that asks for an optimization is an explicit request and overrides LEANTRAIN_DISABLE=1; `--opt cggr=auto` asks "
    "for auto mode explicitly. A target that runs `accelerate launch` in-process (e.g. `trl sft`) is followed into "
    "its child processes."
)
# accelerate.commands.launch functions that start the training processes; each takes the parsed launch arguments.
ACCELERATE_LAUNCHERS = ("simple_launcher", "multi_gpu_launcher", "deepspeed_launcher")


@dataclass(frozen=True)
class Target:
    kind: str  # "file", "module" or "script" (a console script)
    name: str  # path, module name or console-script name
    args: tuple[str, ...]
    entry_point: metadata.EntryPoint | None = None


@dataclass(frozen=True)
class RunRequest:
    options: dict[str, Any]  # keywords for patch_trainer
    target: Target
    prefix: tuple[str, ...]  # the leantrain options as typed: handed to followed child processes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="leantrain run",
        usage=USAGE,
        description="Run a training script, module or console script with every Trainer it builds patched.",
        epilog=EPILOG,
        allow_abbrev=False,
    )
    for name in OPTIMIZATIONS:
        flag = "--" + name.replace("_", "-")
        parser.add_argument(
            flag,
            dest=name,
            action=argparse.BooleanOptionalAction,
            default=None,
            help=f"require {name} (fail if not ready) / turn it off; unset: environment, then default",
        )
    parser.add_argument(
        "--strict",
        action="store_const",
        const=True,
        default=None,
        help="any declined or failing optimization is an error: the run fails before training starts",
    )
    parser.add_argument(
        "--opt",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="any patch_trainer option, e.g. --opt cggr_min_tokens_ratio=0.3 (repeatable)",
    )
    # leantrain compare's children: --measure=SPEC (one token) measures the first trainer's train(); see _measure
    parser.add_argument("--measure", metavar="SPEC", help=argparse.SUPPRESS)
    return parser


def _split(argv: list[str]) -> tuple[list[str], list[str]]:
    """(leantrain options, target and its args). The target is the first token that is not one of our options."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv[:i], argv[i + 1 :]
        if token == "-m" or (token.startswith("-m") and not token.startswith("--")):
            return argv[:i], argv[i:]
        if not token.startswith("-"):
            return argv[:i], argv[i:]
        i += 2 if token == "--opt" else 1
    return argv, []


def _options(parser: argparse.ArgumentParser, ns: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, Any]:
    options: dict[str, Any] = {name: getattr(ns, name) for name in OPTIMIZATIONS if getattr(ns, name) is not None}
    if ns.strict:
        options["strict"] = True
    for item in ns.opt:
        name, sep, value = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not name:
            parser.error(f"--opt {item!r}: expected NAME=VALUE")
        if name in options:
            parser.error(f"option {name!r} given twice")
        options[name] = value
    try:  # the same check patch_trainer makes, now: a typo fails before the target starts
        resolve_config({}, environ, cli=options)
    except (TypeError, ValueError) as error:
        parser.error(str(error))
    return options


def _console_script(name: str) -> metadata.EntryPoint | None:
    found = metadata.entry_points(group="console_scripts").select(name=name)
    return next(iter(found), None)


def _target(parser: argparse.ArgumentParser, tokens: list[str]) -> Target:
    if not tokens:
        parser.error("missing TARGET: a Python file, -m MODULE or an installed console script such as trl")
    head, rest = tokens[0], tuple(tokens[1:])
    if head == "-m" or head.startswith("-m"):
        module = head[2:] or (rest[0] if rest else "")
        rest = rest if head[2:] else rest[1:]
        if not module:
            parser.error("-m needs a module name")
        try:
            spec = find_spec(module)
        except (ImportError, ValueError) as error:  # a parent package that does not import
            parser.error(f"module {module!r} cannot be found: {error}")
        if spec is None:
            parser.error(f"no module named {module!r}")
        return Target("module", module, rest)
    if os.path.isfile(head) or os.path.isfile(os.path.join(head, "__main__.py")):
        return Target("file", head, rest)
    entry_point = None if head.endswith(".py") or os.sep in head else _console_script(head)
    if entry_point is None:
        what = "file" if head.endswith(".py") or os.sep in head else "file or console script"
        parser.error(f"target {head!r} not found: no such {what} (use -m for a module)")
    return Target("script", head, rest, entry_point)


def parse(argv: list[str], environ: Mapping[str, str] | None = None) -> RunRequest:
    """Parse ``leantrain run``'s arguments; bad input exits with status 2 and a message, like argparse."""
    parser = build_parser()
    prefix, tokens = _split(argv)
    ns = parser.parse_args(prefix)
    _no_contradiction(parser, prefix)
    options = _options(parser, ns, os.environ if environ is None else environ)
    return RunRequest(options, _target(parser, tokens), tuple(prefix))


def _no_contradiction(parser: argparse.ArgumentParser, prefix: list[str]) -> None:
    """``--cggr --no-cggr`` asks for two things at once: say so instead of letting the last one win."""
    for name in OPTIMIZATIONS:
        flag = "--" + name.replace("_", "-")
        if flag in prefix and f"--no-{flag[2:]}" in prefix:
            parser.error(f"{flag} and --no-{flag[2:]} contradict each other: give one")


def _env_rank_zero() -> bool:
    return os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0"


def _is_rank_zero(trainer: Any) -> bool:
    check = getattr(trainer, "is_world_process_zero", None)
    if callable(check):
        return bool(check())
    return _env_rank_zero()


@dataclass
class Trainers:
    """The run's trainers as :func:`trainers_patched` saw them."""

    built: int = 0  # Trainer instances constructed (TRL trainers included)
    trained: int = 0  # trainers whose train() ran, whoever patched them
    patched: list[Any] = field(default_factory=list)  # the ones the run patched (not those the target patched itself)

    def why_nothing_patched(self) -> str | None:
        """Why the run patched nothing, in words; None when some trainer trained (patched by the run or by the
        target itself: either way, a report was made)."""
        if self.trained:
            return None
        if not self.built:
            return "the target built no transformers Trainer (TRL trainers included)"
        built = f"{self.built} trainer{'s were' if self.built != 1 else ' was'} built"
        return f"{built}, but train() never ran (leantrain patches a trainer at the start of its train())"


def _wrapped(cls: type, name: str, wrapper: Callable[..., Any]) -> Callable[[], None]:
    """Sets ``cls.<name> = wrapper``; returns what puts the original back (unless someone wrapped ours since)."""
    original = cls.__dict__[name]
    setattr(cls, name, wrapper)

    def restore() -> None:
        if cls.__dict__.get(name) is wrapper:
            setattr(cls, name, original)
        else:  # someone wrapped ours: removing it would drop theirs
            warnings.warn(
                f"leantrain run: {cls.__name__}.{name} was re-wrapped during the run; left in place", RuntimeWarning
            )

    return restore


@contextlib.contextmanager
def trainers_patched(
    options: Mapping[str, Any],
    announce: Callable[[str], None] | None = None,
    around: Callable[..., Any] | None = None,
    kept: Mapping[str, Any] | None = None,
) -> Iterator[Trainers]:
    """Within the block, each Trainer's first ``train()`` patches it first; yields the run's :class:`Trainers`
    (built, trained, patched so far).

    A trainer the target patched itself is left as it is. ``announce`` gets the report (rank 0 only). ``around``
    (``leantrain compare``'s measurement) runs that first ``train()`` as ``around(trainer, original, *args)``.
    """
    from transformers import Trainer  # here, as the entry point (torch): --help and bad input need neither

    from ..entry import command_line, current_report, patch_trainer

    announce = announce or (lambda text: print(text, file=sys.stderr, flush=True))
    original, original_init = Trainer.__dict__["train"], Trainer.__dict__["__init__"]
    seen: weakref.WeakSet[Any] = weakref.WeakSet()
    trainers = Trainers()

    @functools.wraps(original_init)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        trainers.built += 1

    @functools.wraps(original)
    def train(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self not in seen:
            seen.add(self)
            trainers.trained += 1
            if current_report(self) is None:
                report = patch_trainer(self)  # the options come in as the command line's (command_line below)
                trainers.patched.append(self)
                if _is_rank_zero(self):
                    announce(str(report))
            if around is not None:
                return around(self, original, *args, **kwargs)
        return original(self, *args, **kwargs)

    train.__leantrain_original__ = original  # type: ignore[attr-defined]
    init.__leantrain_original__ = original_init  # type: ignore[attr-defined]
    restore = [_wrapped(Trainer, "train", train), _wrapped(Trainer, "__init__", init)]
    try:
        with command_line(options, kept):  # also for a trainer the target patches itself: its keywords rank above
            yield trainers
    finally:
        for undo in restore:
            undo()


def _child_args(request: RunRequest, launch_args: argparse.Namespace) -> None:
    """Turn accelerate's ``[python] [-m] script args`` into ``python -m leantrain run <options> script args``."""
    if getattr(launch_args, "no_python", False):
        warnings.warn(
            "leantrain run: accelerate launch --no_python starts a non-Python program: its trainers are not patched",
            RuntimeWarning,
        )
        return
    script = ["-m", launch_args.training_script] if launch_args.module else [launch_args.training_script]
    launch_args.training_script_args = ["run", *request.prefix, *script, *launch_args.training_script_args]
    launch_args.training_script = "leantrain"
    launch_args.module = True


@contextlib.contextmanager
def launchers_followed(request: RunRequest) -> Iterator[list[str]]:
    """Within the block, processes started by an in-process ``accelerate launch`` run under ``leantrain run``;
    yields the names of the launchers called so far (their children patch, and report, their own trainers)."""
    launched: list[str] = []
    try:
        import accelerate.commands.launch as launch
    except ImportError:
        yield launched
        return
    originals = {name: launch.__dict__[name] for name in ACCELERATE_LAUNCHERS if name in launch.__dict__}

    def follow(original: Callable[[argparse.Namespace], Any]) -> Callable[[argparse.Namespace], Any]:
        @functools.wraps(original)
        def launcher(args: argparse.Namespace) -> Any:
            _child_args(request, args)
            launched.append(original.__name__)
            return original(args)

        return launcher

    wrappers = {name: follow(fn) for name, fn in originals.items()}
    for name, wrapper in wrappers.items():
        setattr(launch, name, wrapper)
    try:
        yield launched
    finally:
        for name, wrapper in wrappers.items():
            if launch.__dict__.get(name) is wrapper:
                setattr(launch, name, originals[name])


@contextlib.contextmanager
def _process_view(argv0: str, args: tuple[str, ...], path0: str | None) -> Iterator[None]:
    """``sys.argv`` (and ``sys.path[0]``) as the target expects them; restored afterwards (tests run in-process)."""
    saved_argv, saved_path = sys.argv, list(sys.path)
    sys.argv = [argv0, *args]
    if path0 is not None:
        if sys.path:
            sys.path[0] = path0
        else:
            sys.path.insert(0, path0)
    try:
        yield
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path


def run_target(target: Target) -> Any:
    """Run the target in this process as ``python FILE``, ``python -m MODULE`` or the console script would."""
    if target.kind == "file":
        path = os.path.abspath(target.name)
        path0 = path if os.path.isdir(path) else os.path.dirname(path)
        with _process_view(target.name, target.args, path0):
            runpy.run_path(path, run_name="__main__")
        return None
    if target.kind == "module":
        with _process_view(target.name, target.args, os.getcwd()):
            runpy.run_module(target.name, run_name="__main__", alter_sys=True)
        return None
    assert target.entry_point is not None
    main = target.entry_point.load()
    with _process_view(target.name, target.args, None):
        return main()


def _exit_code(result: Any) -> int:
    """What ``sys.exit(result)`` would exit with: console-script wrappers do ``sys.exit(main())``."""
    if result is None:
        return 0
    if isinstance(result, int):
        return result
    print(result, file=sys.stderr)
    return 1


def main(argv: list[str] | None = None) -> int:
    request = parse(list(sys.argv[1:] if argv is None else argv))
    spec = _measure.spec_from_prefix(request.prefix)
    target = request.target
    typed = ("-m", target.name) if target.kind == "module" else (target.name,)
    stock = spec is not None and spec.mode == "stock"
    kept = {} if stock else _keep.kept_for(request.options, target=typed)
    options = request.options
    around = _measure.measured_train(spec) if spec is not None else None
    from ..entry import NotReadyError

    with contextlib.ExitStack() as stack:
        trainers = stack.enter_context(trainers_patched(options, around=around, kept=kept))
        launched = stack.enter_context(launchers_followed(request))
        try:
            result = run_target(request.target)
        except _measure.MeasureDone:  # a compare child: the first trainer was measured, the rest of the script skipped
            return 0
        except NotReadyError as error:
            print(f"leantrain run: error: {error} (nothing was trained)", file=sys.stderr, flush=True)
            return 1
        except SystemExit as done:  # the target's sys.exit(): its status is the run's
            code = _exit_code(done.code)
        else:
            code = _exit_code(result)
    _say_if_nothing_patched(trainers, launched)
    return code


def _say_if_nothing_patched(trainers: Trainers, launched: list[str]) -> None:
    """One line on stderr (rank 0) when the target ended without a trainer patched: a run that silently changed
    nothing reads like one that worked. Children started by a followed launcher report for themselves."""
    why = trainers.why_nothing_patched()
    if why is None or launched or not _env_rank_zero():
        return
    print(f"leantrain run: nothing was patched: {why}", file=sys.stderr, flush=True)
