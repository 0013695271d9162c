"""The one table of leantrain options: a dataclass whose fields are the options, their env vars and checks.

Precedence is keyword in code > command line (``leantrain run``'s flags) > environment (``LEANTRAIN_<FIELD>``) >
default; each resolved value keeps its source. Environment variables are read at ``patch_trainer`` time and never
written.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal


ENV_PREFIX = "LEANTRAIN_"
Source = Literal["kwarg", "cli", "env", "kept", "default"]

_TRUE = {"1", "on", "yes", "true"}
_FALSE = {"0", "off", "no", "false"}
_SWITCH_WORDS = "1/0/on/off/yes/no/true/false"  # _TRUE and _FALSE, as messages list them

# Optimizations in the order they are applied: model surgery first, then forward/loss patches. fused_ce comes before
# cggr: CGGR wraps the loss computation fused_ce installs, so the labels CGGR masks feed the fused loss. compile_layers
# comes after everything that rebinds code inside the decoder layers, so it compiles what will run; offload_checkpoints
# comes after compile_layers: it wraps the layer forward that runs (the compiled one inside the checkpoint).
# padding_free changes the batches, not the model: last.
OPTIMIZATIONS = (
    "moe4bit",
    "osft",
    "layer_kernels",
    "compile_layers",
    "fused_ce",
    "cggr",
    "grpo_logps",
    "compile_generation",
    "offload_checkpoints",
    "padding_free",
)
CGGR_SCORINGS = ("entropy", "margin", "loss", "combined", "random")
OSFT_PRECISIONS = ("fp32", "tf32", "bf16", "tf32x3", "bf16x3")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
COMPILE_DYNAMIC = ("auto", "always")
COMPILE_RECOMPUTE = ("default", "elementwise")
# torch._dynamo's own per-function limit is 8 compiled entries; past it Dynamo runs the frame eagerly without a
# word, so leantrain's limit must bite first (at most 6 recompiles: 7 entries).
MAX_LAYER_RECOMPILES = 6


def _ratio(value: float) -> str | None:
    return None if 0.0 < value <= 1.0 else f"must be in (0, 1], got {value!r}"


def _at_least(low: int) -> Callable[[int], str | None]:
    return lambda value: None if value >= low else f"must be >= {low}, got {value!r}"


def _nonzero(value: int) -> str | None:
    # The range depends on the model's layer count: checked at patch_trainer time (cggr.resolve_router_layer).
    return None if value != 0 else "must be a layer: N >= 1 (after decoder layer N) or negative from the top, got 0"


@dataclass(frozen=True)
class _OneOf:
    """The check of a named-choice option; it keeps its choices so that the docs' tables can list them."""

    choices: tuple[str, ...]

    def __call__(self, value: str) -> str | None:
        if value in self.choices:
            return None
        return f"must be one of {', '.join(map(repr, self.choices))}, got {value!r}"


def _one_of(*choices: str) -> _OneOf:
    return _OneOf(choices)


def _opt(default: Any, kind: str, doc: str, check: Callable[[Any], str | None] | None = None) -> Any:
    return field(default=default, metadata={"kind": kind, "doc": doc, "check": check})


@dataclass(frozen=True)
class LeantrainConfig:
    """Every leantrain option. ``kind`` drives env parsing: tristate (auto/1/0), bool, int, float, str, names."""

    # Toggles: None = auto (apply if the probe passes), True = required, False = off.
    cggr: bool | None = _opt(
        False, "tristate", "CGGR: labels kept on the hardest tokens only (changes which tokens train: opt-in)"
    )
    grpo_logps: bool | None = _opt(None, "tristate", "fused GRPO/RLOO log-probs and entropies, no [B,T,V] logits")
    osft: bool | None = _opt(False, "tristate", "orthogonal subspace fine-tuning (changes the model: opt-in)")
    moe4bit: bool | None = _opt(None, "tristate", "grouped 4-bit MoE experts instead of the per-expert loop")
    layer_kernels: bool | None = _opt(
        None,
        "tristate",
        "Liger-Kernel's RMSNorm, SwiGLU/GeGLU and RoPE kernels on this model's modules (auto: the model families "
        "where they measured faster; needs the liger-kernel package and CUDA)",
    )
    compile_layers: bool | None = _opt(
        None,
        "tristate",
        "torch.compile of each decoder layer (one compiled code shared by every layer; auto: CUDA, where the measured "
        "saving pays the compile back within the run's steps)",
    )
    fused_ce: bool | None = _opt(
        None, "tristate", "SFT / Trainer causal-LM loss from hidden states and the LM head, no [B,T,V] logits"
    )
    compile_generation: bool | None = _opt(
        None,
        "tristate",
        "GRPO / RLOO generation: transformers' generate with its decode step compiled over a static KV cache (auto: "
        "CUDA, where the measured saving pays the compile back within the run's generation calls)",
    )
    offload_checkpoints: bool | None = _opt(
        None,
        "tristate",
        "activation checkpointing: each checkpointed decoder layer's input in pinned host memory, copied on a side "
        "stream (auto: CUDA micro-batches of at least 16384 tokens, from which its step cost measured within 3%; "
        "needs the trainer's gradient_checkpointing)",
    )
    padding_free: bool | None = _opt(
        None,
        "tristate",
        "SFTTrainer: each batch's rows as one row of their real tokens, position ids restarting per row (TRL's "
        "padding-free collator; the same loss and gradients, no padding computed or kept; on CUDA in 16 bits SDPA "
        "runs as flash attention over the rows' boundaries; auto: with that attention, where the shuffled padded "
        "batches would be 25% padding or more)",
    )
    disable: bool = _opt(
        False,
        "bool",
        "kill switch: every optimization off, env toggles included (only <name>=True in code or a --<name> flag wins)",
    )
    strict: bool = _opt(False, "bool", "turn every fallback (probe or runtime) into an error")
    # CGGR
    cggr_min_tokens_ratio: float = _opt(0.25, "float", "fraction of each sequence's labels kept", _ratio)
    cggr_router_layers: int = _opt(
        2,
        "int",
        "router depth: scores after decoder layer N; negative from the top, -1 = final hidden state",
        _nonzero,
    )
    cggr_scoring: str = _opt("entropy", "str", "token difficulty score", _one_of(*CGGR_SCORINGS))
    cggr_warmup_steps: int = _opt(100, "int", "optimizer steps trained on all labels first", _at_least(0))
    cggr_ratio_schedule: str = _opt("constant", "str", "ratio during warmup", _one_of("constant", "linear"))
    # Fused loss
    fused_ce_tile_mib: int = _opt(
        256,
        "int",
        "memory bound of one logits tile of the fused loss, MiB (smaller than a decoder layer's activations, so the "
        "loss never sets the step's peak)",
        _at_least(1),
    )
    # Fused log-probs
    grpo_logps_tile_mib: int = _opt(512, "int", "memory bound of one logits tile, MiB", _at_least(1))
    grpo_logps_keep_logits_mib: int = _opt(
        0,
        "int",
        "trainable head: keep the forward's logits tiles for the backward when they fit in this many MiB (saves one "
        "of four GEMMs; costs N·V·2 bytes in bf16)",
        _at_least(0),
    )
    # OSFT
    osft_unfrozen_rank_ratio: float = _opt(0.5, "float", "fraction of each target's rank that trains", _ratio)
    osft_targets: tuple[str, ...] | None = _opt(None, "names", "target module name patterns (comma-separated)")
    osft_projection_precision: str = _opt(
        "tf32x3",
        "str",
        "projection GEMMs for fp32 factors on CUDA: tf32x3 (fp32-level, a Triton GEMM; fp32 where it declines), "
        "fp32 (exact cuBLAS), tf32 (fastest, ~1e-4), bf16x3",
        _one_of(*OSFT_PRECISIONS),
    )
    osft_cache_v_high: bool = _opt(
        False,
        "bool",
        "FSDP2 Shard(0) V: keep the all-gathered frozen V_high between steps (no per-step all-gather; costs the "
        "full V_high on every rank)",
    )
    # Compiled decoder layers
    compile_layers_backend: str = _opt(
        "inductor", "str", "torch.compile backend of the decoder layers", _one_of(*COMPILE_BACKENDS)
    )
    compile_layers_dynamic: str = _opt(
        "auto",
        "str",
        "sequence lengths: auto (static first, dynamic from the first new length: one recompile), always (dynamic "
        "from the start)",
        _one_of(*COMPILE_DYNAMIC),
    )
    compile_layers_recompute: str = _opt(
        "default",
        "str",
        "what the compiled layers save for their backward: default (torch's choice, the fastest backward), "
        "elementwise (only matmul, attention and reduction outputs: norms, activations and casts are recomputed in "
        "the backward; less saved per layer, but on a GPU no lower layer peak and more elementwise work)",
        _one_of(*COMPILE_RECOMPUTE),
    )
    compile_layers_mlp_chunks: int = _opt(
        0,
        "int",
        "row chunks of a gated LoRA MLP's backward inside the compiled layers (Llama, Mistral, Qwen2/3 MLPs with LoRA "
        "on gate, up and down, 16-bit compute): the three projections as one function whose full-width gradients "
        "are built a chunk at a time, a lower layer peak (about 90 MiB less at 8192 tokens on Llama-3.2-1B with 2) "
        "for more host work per layer (10-13% of the step with every micro-batch chunked; with varying lengths, "
        "where only the long ones are, the offload and the chunks cost 0.8% over 24 pairs); where the trainer has a "
        "max_length, only "
        "micro-batches of at least half of batch x max_length (the ones that set the peak); 0: autograd's backward "
        "through each projection",
        lambda v: None if 0 <= v <= 64 else f"must be in [0, 64], got {v!r}",
    )
    compile_layers_background: bool | None = _opt(
        None,
        "tristate",
        "compile the layers in a child process while training goes on: the first steps run the layers "
        "uncompiled (eager speed) and the compiled code takes over at the first step boundary after it is ready, "
        "instead of the first step waiting for the whole compile (inductor backend, static shapes: "
        "compile_layers_dynamic='auto'; a graph with dynamic shapes still compiles in the training process); auto: "
        "on CUDA for MoE layers whose 4-bit experts moe4bit serves (measured: a first step of 6-8 s instead of "
        "18-23, the run as long)",
    )
    compile_layers_max_recompiles: int = _opt(
        4,
        "int",
        f"recompiles of the layer code before the eager layers take over for the run (0-{MAX_LAYER_RECOMPILES})",
        lambda v: None if 0 <= v <= MAX_LAYER_RECOMPILES else f"must be in [0, {MAX_LAYER_RECOMPILES}], got {v!r}",
    )
    # Compiled generation
    compile_generation_backend: str = _opt(
        "inductor", "str", "torch.compile backend of the decode step", _one_of(*COMPILE_BACKENDS)
    )
    compile_generation_cuda_graphs: bool = _opt(
        True,
        "bool",
        "replay the compiled decode step as CUDA graphs (inductor on CUDA; what mode='reduce-overhead' does)",
    )
    compile_generation_max_recompiles: int = _opt(
        4,
        "int",
        "recompiles of the decode step (new batch sizes, longer prompts) before stock generate takes over "
        f"(0-{MAX_LAYER_RECOMPILES})",
        lambda v: None if 0 <= v <= MAX_LAYER_RECOMPILES else f"must be in [0, {MAX_LAYER_RECOMPILES}], got {v!r}",
    )
    # Offloaded checkpoints
    offload_checkpoints_max_host_gib: float = _opt(
        0.0,
        "float",
        "host memory the offloaded inputs may hold at once, GiB (0: half of the host memory available at patch time, "
        "shared by the processes on the host); inputs past it stay on the device",
        lambda v: None if v >= 0 else f"must be >= 0, got {v!r}",
    )
    offload_checkpoints_layers: int = _opt(
        0,
        "int",
        "how many decoder layers' checkpointed inputs move to host memory, spread evenly over the stack (the others "
        "stay on the device, as stock checkpointing keeps them): fewer copies and less host work a step for less "
        "memory saved; 0: every layer",
        lambda v: None if 0 <= v <= 4096 else f"must be in [0, 4096], got {v!r}",
    )
    # MoE 4-bit
    moe_recompute: bool | None = _opt(
        None,
        "tristate",
        "re-dequantize expert stacks in backward instead of saving them (auto: per layout, from measurements)",
    )

    @classmethod
    def options(cls) -> tuple[dataclasses.Field, ...]:
        return dataclasses.fields(cls)

    @staticmethod
    def env_name(field_name: str) -> str:
        return ENV_PREFIX + field_name.upper()


@dataclass(frozen=True)
class ResolvedConfig:
    """A config plus where each value came from."""

    config: LeantrainConfig
    sources: Mapping[str, Source]

    def __getattr__(self, name: str) -> Any:
        return getattr(self.config, name)


def _parse(kind: str, raw: str, name: str) -> Any:
    text = raw.strip()
    low = text.lower()
    if kind == "tristate" and low in ("auto", ""):
        return None
    if kind in ("tristate", "bool"):
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        extra = "/auto" if kind == "tristate" else ""
        raise ValueError(f"{name}={raw!r}: expected one of {_SWITCH_WORDS}{extra}")
    try:
        if kind == "int":
            return int(text)
        if kind == "float":
            return float(text)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected a {kind}") from None
    if kind == "names":
        names = tuple(part.strip() for part in text.split(",") if part.strip())
        return names or None
    return text


def _switch(kind: str, value: Any, name: str) -> bool | None:
    """A tristate or bool keyword: True/False (None, auto, for a tristate), or the ints 1 and 0, read as the strings
    "1" and "0" are. Anything else raises naming what is accepted."""
    if isinstance(value, bool) or (value is None and kind == "tristate"):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    accepted = (
        f"True, False or None (auto); 1 or 0; or one of the strings {_SWITCH_WORDS}/auto"
        if kind == "tristate"
        else f"True or False; 1 or 0; or one of the strings {_SWITCH_WORDS}"
    )
    error = ValueError if isinstance(value, int) else TypeError  # an int out of range, or not a switch at all
    raise error(f"{name}={value!r}: expected {accepted}")


def _coerce(kind: str, value: Any, name: str) -> Any:
    """Type-check a keyword value; strings are parsed like environment values."""
    if isinstance(value, str) and kind != "str":
        return _parse(kind, value, name)
    if kind in ("tristate", "bool"):
        return _switch(kind, value, name)
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "str": isinstance(value, str),
        "names": value is None or (isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value)),
    }[kind]
    if not ok:
        raise TypeError(f"{name}={value!r}: expected {kind}")
    if kind == "float":
        return float(value)
    if kind == "names" and value is not None:
        return tuple(value) or None
    return value


def _suggest(name: str, known: list[str]) -> str:
    """The close matches, or (nothing close) every name there is: a guess from far off is no help."""
    close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
    if close:
        return f" (did you mean {' or '.join(close)}?)"
    return f"; the options are {', '.join(known)}"


def as_typed(name: str, value: Any, source: str) -> str:
    """A setting as the user wrote it, for messages: ``cggr=True``, ``--cggr``, ``LEANTRAIN_CGGR=1``."""
    if source in ("kwarg", "default", "kept"):
        return f"{name}={value!r}" + (" (kept by leantrain compare)" if source == "kept" else "")
    flag = "--" + name.replace("_", "-")
    if source == "cli" and isinstance(value, bool) and (name in OPTIMIZATIONS or (name == "strict" and value)):
        return flag if value else f"--no-{flag[2:]}"
    text = ",".join(value) if isinstance(value, tuple) else {None: "auto", True: "1", False: "0"}.get(value, value)
    return f"{LeantrainConfig.env_name(name)}={text}" if source == "env" else f"--opt {name}={text}"


def _checked(f: dataclasses.Field, value: Any, origin: str, parse: bool) -> Any:
    """One given value, parsed (environment) or type-checked (keyword, command line), then range-checked."""
    kind, check = f.metadata["kind"], f.metadata["check"]
    value = _parse(kind, value, origin) if parse else _coerce(kind, value, origin)
    problem = check(value) if check and value is not None else None
    if problem:
        raise ValueError(f"{origin} {problem}")
    return value


def _layer(layer: Mapping[str, Any], fields: Mapping[str, dataclasses.Field], unknown: str) -> dict[str, Any]:
    """Keyword or command-line values, checked; a tristate None means "not given" (auto unless a lower layer says)."""
    for name in layer:
        if name not in fields:
            raise TypeError(f"{unknown} {name!r}{_suggest(name, list(fields))}")
    return {
        name: _checked(fields[name], value, name, parse=False)
        for name, value in layer.items()
        if value is not None or fields[name].metadata["kind"] != "tristate"
    }


def resolve_config(
    kwargs: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
    kept: Mapping[str, Any] | None = None,
) -> ResolvedConfig:
    """Build the config from keywords, then the command line (``leantrain run``'s options: ``cli``), then
    ``LEANTRAIN_*`` variables, then what ``leantrain compare --keep`` kept for this target (``kept``), then
    defaults. Every value given is checked, whether or not a higher layer overrides it; anything unknown, unparsable
    or contradictory raises."""
    environ = os.environ if environ is None else environ
    fields = {f.name: f for f in LeantrainConfig.options()}
    env_names = {LeantrainConfig.env_name(n): n for n in fields}
    for var in environ:
        if var.startswith(ENV_PREFIX) and var not in env_names:
            raise ValueError(f"unknown environment variable {var}{_suggest(var, list(env_names))}")
    layers: list[tuple[Source, dict[str, Any]]] = [
        ("kwarg", _layer(kwargs, fields, "patch_trainer() got an unknown option")),
        ("cli", _layer(cli or {}, fields, "unknown option")),
        ("env", {n: _checked(fields[n], environ[v], v, parse=True) for v, n in env_names.items() if v in environ}),
        ("kept", _layer(kept or {}, fields, "unknown kept option")),
    ]
    values: dict[str, Any] = {}
    sources: dict[str, Source] = {}
    for name, f in fields.items():
        source = next((source for source, given in layers if name in given), "default")
        values[name] = dict(layers)[source][name] if source != "default" else f.default
        sources[name] = source
    resolved = ResolvedConfig(LeantrainConfig(**values), sources)
    _contradiction(resolved)
    _background_needs(resolved.config)
    return resolved


def _contradiction(cfg: ResolvedConfig) -> None:
    """The kill switch and ``<name>=True`` from the same explicit source (both keywords in code, or both on the
    command line) ask for opposite things: say so instead of guessing. From different sources the higher one wins
    (``entry`` applies that rule)."""
    source = cfg.sources["disable"]
    if not cfg.config.disable or source not in ("kwarg", "cli"):
        return
    asked = [n for n in OPTIMIZATIONS if getattr(cfg.config, n) is True and cfg.sources[n] == source]
    if not asked:
        return
    switch, request = as_typed("disable", True, source), as_typed(asked[0], True, source)
    both = f"patch_trainer({switch}, {request})" if source == "kwarg" else f"{switch} and {request}"
    wins = f"{request} in code" if source == "kwarg" else request
    raise ValueError(
        f"{both}: the kill switch and a required optimization contradict each other; drop one (with "
        f"LEANTRAIN_DISABLE=1 in the environment, {wins} wins)"
    )


def _background_needs(cfg: LeantrainConfig) -> None:
    """``compile_layers_background`` hands inductor's work to a child process: with another backend there is no
    such work, and with dynamic shapes from the start every graph would compile in the training process anyway."""
    if not cfg.compile_layers_background:
        return
    if cfg.compile_layers_backend != "inductor":
        raise ValueError(
            f"compile_layers_background=True needs compile_layers_backend='inductor' (got "
            f"{cfg.compile_layers_backend!r}: no inductor lowering for a child process to take over)"
        )
    if cfg.compile_layers_dynamic != "auto":
        raise ValueError(
            f"compile_layers_background=True needs compile_layers_dynamic='auto' (got {cfg.compile_layers_dynamic!r}: "
            "graphs with dynamic shapes compile in the training process, so nothing would run in the background)"
        )


# --- the docs' generated blocks (testkit/doc_blocks.py writes them; a test keeps them equal) -----------------------


def patch_trainer_signature() -> str:
    """``patch_trainer``'s keywords as the docs show them: one toggle per optimization in apply order, then strict
    (``tests/unit/test_patching.py`` keeps the function's own signature in this order)."""
    keywords = [f"{name}=None" for name in (*OPTIMIZATIONS, "strict")]
    body = textwrap.fill(", ".join(["trainer", "*", *keywords, "**options"]) + ",", width=115, break_long_words=False)
    return "leantrain.patch_trainer(\n" + textwrap.indent(body, "    ") + "\n) -> leantrain.PatchReport"


def _values(f: dataclasses.Field) -> str:
    """What an option takes, as the environment and ``--opt NAME=VALUE`` spell it."""
    check = f.metadata["check"]
    if isinstance(check, _OneOf):
        return ", ".join(check.choices)
    kind = f.metadata["kind"]
    return {"tristate": "auto, 1, 0", "bool": "1, 0", "names": "comma-separated"}.get(kind, kind)


def _default(f: dataclasses.Field) -> str:
    if f.metadata["kind"] == "names":
        return "per model"
    return str({None: "auto", True: "1", False: "0"}.get(f.default, f.default))


def _cell(text: str) -> str:
    """Text for a Markdown table cell: a pipe would end the cell and ``<name>`` would read as an HTML tag."""
    return text.replace("|", "\\|").replace("<", "\\<")


def env_table_markdown() -> str:
    """The README's environment-variable table, generated from the dataclass."""
    rows = ["| variable | values | default | what it does |", "| --- | --- | --- | --- |"]
    for f in LeantrainConfig.options():
        rows.append(
            f"| `{LeantrainConfig.env_name(f.name)}` | {_values(f)} | {_default(f)} | {_cell(f.metadata['doc'])} |"
        )
    return "\n".join(rows)


def options_table_markdown() -> str:
    """docs/configuration.md's table: every option by its keyword, with its variable, values, default and use."""
    rows = ["| option | variable | values | default | what it does |", "| --- | --- | --- | --- | --- |"]
    for f in LeantrainConfig.options():
        variable = LeantrainConfig.env_name(f.name)
        rows.append(f"| `{f.name}` | `{variable}` | {_values(f)} | {_default(f)} | {_cell(f.metadata['doc'])} |")
    return "\n".join(rows)
