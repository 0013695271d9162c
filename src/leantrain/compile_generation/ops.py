"""The compiled decoding's arithmetic, in plain values: how long the static KV cache is, what it costs in memory, and
whether compiling pays for itself within a run's generation calls."""

from __future__ import annotations

from dataclasses import dataclass


CACHE_ALIGN = 64  # cache lengths are multiples of this: one compiled decode serves every prompt length under it
GROWTH = 1.5  # a longer prompt grows the cache by at least this factor: few lengths, so few recompiles


def cache_length(needed: int, current: int = 0) -> int:
    """The static cache's length for a call that needs ``needed`` positions (prompt + new tokens), given the cache
    already built (``current``, 0 for none): the same cache while it is long enough, else a longer one, grown
    geometrically and aligned, so a run whose prompts vary in length compiles the decode step a few times at most."""
    if needed < 1:
        raise ValueError(f"a generation call needs at least one position, got {needed}")
    if current >= needed:
        return current
    target = max(needed, int(current * GROWTH))
    return -(-target // CACHE_ALIGN) * CACHE_ALIGN


@dataclass(frozen=True)
class CacheShape:
    """What one cache position costs: every decoder layer keeps a key and a value of ``kv_heads`` x ``head_dim``."""

    layers: int
    kv_heads: int
    head_dim: int
    bytes_per_value: int  # 2 for bf16 / fp16, 4 for fp32

    @property
    def bytes_per_token(self) -> int:
        """One position of one sequence, every layer, keys and values."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.bytes_per_value

    def bytes(self, batch: int, length: int) -> int:
        return self.bytes_per_token * batch * length


@dataclass(frozen=True)
class Payback:
    """Whether compiling the decode step pays for itself: ``calls`` generation calls in the run, each generating up to
    ``tokens`` tokens, each token ``saving_ms`` faster, against ``compile_s`` seconds of compiling (the first call's
    extra time)."""

    calls: int
    tokens: int
    saving_ms: float  # per decoded token (one forward of the whole batch)
    compile_s: float

    @property
    def saving_s(self) -> float:
        """The whole run's saving, every call generating its full ``tokens`` (sequences that stop early save less)."""
        return self.calls * self.tokens * self.saving_ms / 1000.0

    @property
    def break_even(self) -> int:
        """The generation call from which the saving exceeds the compile time (-1: never)."""
        per_call = self.tokens * self.saving_ms / 1000.0
        return -1 if per_call <= 0 else int(self.compile_s / per_call) + 1

    @property
    def pays(self) -> bool:
        return self.saving_ms > 0 and self.saving_s > self.compile_s

    def sentence(self) -> str:
        if self.saving_ms <= 0:
            return "compiled decoding measured no saving a token"
        return (
            f"{self.calls} generation calls x {self.tokens} tokens x {self.saving_ms:.1f} ms saved = "
            f"{self.saving_s:.0f} s against {self.compile_s:.0f} s of compiling (pays back from call "
            f"{self.break_even})"
        )
