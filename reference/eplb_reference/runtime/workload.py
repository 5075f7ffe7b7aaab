"""Batches as a server sees them: prefill, decode and mixed, padded to fixed capture sizes.

Token popularity is skewed (most tokens come from a small hot vocabulary slice, which the
router turns into a hot set of experts) and the hot slice drifts every ``drift_every``
steps, so EPLB has to keep rebalancing. Seeded: rank r at step s always gets the same batch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor  # [1, capture_size] token ids, padding after num_tokens
    num_tokens: int  # real (unpadded) tokens
    is_prefill: bool  # any prefill work in the batch
    kind: str  # "prefill" | "decode" | "mixed"

    def to(self, device: torch.device | str) -> Batch:
        return replace(self, tokens=self.tokens.to(device))


@dataclass(frozen=True)
class WorkloadSpec:
    vocab_size: int
    capture_sizes: tuple[int, ...] = (16, 64)  # decode batches use the smallest, others the largest
    decode_tokens: int = 16
    prefill_tokens: int = 48
    prefill_every: int = 8  # one prefill (or mixed) batch every N steps; the rest decode
    hot_fraction: float = 0.1  # share of the vocabulary that is hot
    hot_probability: float = 0.85  # share of tokens drawn from the hot slice
    drift_every: int = 40
    seed: int = 0

    def validate(self) -> None:
        if not self.capture_sizes or min(self.capture_sizes) < 1:
            raise ValueError(f"capture sizes must be positive token counts, got {list(self.capture_sizes)}")
        largest = max(self.capture_sizes)
        for name, count in (("decode_tokens", self.decode_tokens), ("prefill_tokens", self.prefill_tokens)):
            if count > largest:
                raise ValueError(f"{name}={count} exceeds the largest capture size {largest}")
            if count <= 0:
                raise ValueError(f"{name} must be positive, got {count}")

    def batch_tokens(self) -> dict[str, int]:
        return {
            "decode": self.decode_tokens,
            "prefill": self.prefill_tokens,
            "mixed": min(self.prefill_tokens + self.decode_tokens, max(self.capture_sizes)),
        }

    def capture_sizes_used(self) -> set[int]:
        return {capture_size_for(n, self.capture_sizes) for n in self.batch_tokens().values()}


def capture_size_for(num_tokens: int, capture_sizes: tuple[int, ...]) -> int:
    fitting = [size for size in sorted(capture_sizes) if size >= num_tokens]
    if not fitting:
        raise ValueError(f"a batch of {num_tokens} tokens exceeds every capture size {sorted(capture_sizes)}")
    return fitting[0]


def make_batch(spec: WorkloadSpec, step: int, rank: int) -> Batch:
    gen = torch.Generator().manual_seed(spec.seed * 7_919 + step * 104_729 + rank)
    cycle = step % spec.prefill_every
    kind = "decode" if cycle else ("prefill" if (step // spec.prefill_every) % 2 == 0 else "mixed")
    num_tokens = spec.batch_tokens()[kind]
    size = capture_size_for(num_tokens, spec.capture_sizes)
    hot_count = max(1, int(spec.vocab_size * spec.hot_fraction))
    offset = (step // spec.drift_every) * hot_count * 3 % spec.vocab_size  # the hot slice drifts
    hot = (offset + torch.randint(0, hot_count, (num_tokens,), generator=gen)) % spec.vocab_size
    cold = torch.randint(0, spec.vocab_size, (num_tokens,), generator=gen)
    tokens = torch.where(torch.rand(num_tokens, generator=gen) < spec.hot_probability, hot, cold)
    padded = torch.zeros(1, size, dtype=torch.long)
    padded[0, :num_tokens] = tokens
    return Batch(padded, num_tokens, kind != "decode", kind)
