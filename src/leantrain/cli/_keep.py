"""What ``leantrain compare --keep`` decided, kept for ``leantrain run``: ``leantrain.json`` in the working directory.

``--keep`` writes one entry per optimization the compared run applied, in the ``options`` section of the file (the
same ``{"value": ..., "source": ...}`` shape as the record that ``save_model()`` writes), with source ``compare``:
``auto`` (or ``true`` for an opt-in one that was asked for) where the run was faster or leaner with the same losses,
``false`` where it was not. ``leantrain run`` reads those entries (and only those: a record of a past run in the
same folder changes nothing) below the command line and the environment: command line > ``LEANTRAIN_*`` >
``leantrain.json`` > default, for the target it was measured on only. An entry that neither sets applies with its
own source, ``kept`` in the report (``leantrain run`` announces which, and the verdict that produced it). With the
kill switch on (``LEANTRAIN_DISABLE=1`` or ``--opt disable=1``) the file is not read."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from ..config import LeantrainConfig, resolve_config


KEEP_FILE = "leantrain.json"
SOURCE = "compare"


def _value(value: Any) -> Any:
    return "auto" if value is None else value


def kept_target(path: str = KEEP_FILE) -> list[str] | None:
    """The target (script, ``-m`` module or console script, with its arguments) the kept entries were measured on."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError):
        return None
    target = data.get("compare", {}).get("target") if isinstance(data, dict) else None
    return list(target) if isinstance(target, list) else None


def target_key(tokens: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """What identifies a target, its arguments left out: ("-m", module), or the script's absolute path, or the
    console script's name."""
    head = list(tokens)[:2]
    if head and head[0] == "-m":
        return ("-m", head[1] if len(head) > 1 else "")
    if head and head[0].startswith("-m"):
        return ("-m", head[0][2:])
    if not head:
        return ()
    return (os.path.abspath(head[0]) if os.path.exists(head[0]) else head[0],)


def same_target(kept: list[str] | None, target: tuple[str, ...] | list[str]) -> bool:
    """The kept entries apply to the target they were measured on (its arguments may differ: they are the run's
    own). A file that names no target applies as it did when no target was recorded."""
    return kept is None or target_key(kept) == target_key(target)


def read(path: str = KEEP_FILE) -> dict[str, Any]:
    """``{name: value}`` of the entries ``leantrain compare --keep`` wrote; {} when there is no such file."""
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not readable as JSON ({error})") from None
    options = data.get("options") if isinstance(data, dict) else None
    if not isinstance(options, dict):
        return {}
    return {
        name: entry.get("value")
        for name, entry in options.items()
        if isinstance(entry, dict) and entry.get("source") == SOURCE
    }


def _kill_switch(options: Mapping[str, Any], environ: Mapping[str, str]) -> bool:
    """On from the environment or the command line (``--opt disable=1``): then nothing kept is read."""
    return resolve_config({}, environ, cli=options).config.disable


def with_kept(
    options: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    path: str = KEEP_FILE,
    announce: Callable[[str], None] | None = None,
    target: tuple[str, ...] | list[str] | None = None,
) -> dict[str, Any]:
    """``options`` (the command line's) with the kept entries of :func:`kept_for` below them, in one mapping."""
    return {**kept_for(options, environ, path, announce, target), **options}


def kept_for(
    options: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    path: str = KEEP_FILE,
    announce: Callable[[str], None] | None = None,
    target: tuple[str, ...] | list[str] | None = None,
) -> dict[str, Any]:
    """The kept entries that neither the command line (``options``) nor a ``LEANTRAIN_*`` variable sets, when
    ``target`` is the one they were measured on (another script in the same folder gets none of them): the ``kept``
    layer of the run's options, below the environment. A kept value that no longer parses exits with status 2, as a
    bad command-line option does."""
    environ = os.environ if environ is None else environ
    announce = announce or _stderr
    try:
        kept = read(path)
    except ValueError as error:
        raise SystemExit(f"leantrain run: error: {error}") from None
    if not kept:
        return {}
    measured = kept_target(path)
    if target is not None and not same_target(measured, target):
        shown = " ".join(measured or [])
        announce(f"leantrain run: {path} (leantrain compare --keep) not read: it was measured on {shown}, not this")
        return {}
    if _kill_switch(options, environ):
        announce(f"leantrain run: {path} (leantrain compare --keep) not read: the kill switch is on")
        return {}
    take = {n: v for n, v in kept.items() if n not in options and LeantrainConfig.env_name(n) not in environ}
    try:
        resolve_config({}, environ, cli=options, kept=take)
    except (TypeError, ValueError) as error:
        raise SystemExit(f"leantrain run: error: {path} (leantrain compare --keep): {error}") from None
    if take:
        listed = ", ".join(f"{n}={_value(v)}" for n, v in take.items())
        verdict = _kept_verdict(path)
        because = f" (from the verdict: {verdict})" if verdict else ""
        announce(f"leantrain run: options kept by leantrain compare in {path}: {listed}{because}")
    return take


def _kept_verdict(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle).get("compare", {}).get("verdict")
    except (OSError, ValueError, AttributeError):
        return None


def write(decisions: Mapping[str, Any], summary: Mapping[str, Any], path: str = KEEP_FILE) -> None:
    """Merge ``decisions`` ({name: True / False / None}) into ``path``'s options (other entries and keys stay),
    with the compare summary under ``"compare"``."""
    data: dict[str, Any] = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as handle:
            loaded = json.load(handle)
        data = loaded if isinstance(loaded, dict) else {}
    options = data.get("options") if isinstance(data.get("options"), dict) else {}
    for name, value in decisions.items():
        options[name] = {"value": _value(value), "source": SOURCE}
    data["options"] = options
    data["compare"] = dict(summary)
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2)
        handle.write("\n")
    os.replace(tmp, path)


def _stderr(text: str) -> None:
    if os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")) == "0":
        print(text, file=sys.stderr, flush=True)


def decisions(options: Mapping[str, Any], result: dict[str, Any]) -> dict[str, Any]:
    """For each optimization the leantrain runs applied: auto (True for an opt-in one or one the command line
    required) when the verdict claimed it helped, False when it claimed it hurt, and nothing at all when the
    verdict made no claim (noise, a busy machine, too few steps): a kept option never comes from noise. The
    applied set is measured as a whole."""
    if result.get("keep") is None:
        return {}
    decisions: dict[str, Any] = {}
    for name in result["applied"]:
        if result["keep"] == "helped":
            asked = options.get(name) is True or name in result["changes_math"]
            decisions[name] = True if asked else None
        else:
            decisions[name] = False
    return decisions
