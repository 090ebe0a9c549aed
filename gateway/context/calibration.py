"""How a provider's token count relates to the gateway's own (pure, deterministic).

The gateway counts with tiktoken; a local model's tokenizer and chat template count differently
(SmolLM2 on llama.cpp: ~1.12x cl100k plus a 21-token default system prompt). From the
`prompt_tokens` a provider reports for prompts the gateway counted, `fit` learns
`theirs ≈ ratio * ours + overhead` and a margin covering the worst miss seen, so the window is
planned in the gateway's units against the provider's real limit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from gateway.types import JSONObject

# Newest (ours, theirs) pairs kept per (provider, model).
MAX_OBSERVATIONS = 64
# Below this spread of prompt sizes a slope cannot be told from an intercept: ratio only.
_MIN_SPREAD = 32
# Added to the worst miss seen: rounding, and prompts a little unlike the ones observed.
_EXTRA_MARGIN = 2
# No tokenizer counts text 5x another (nor a fifth): a pair outside is not a count of the same
# prompt (a provider error's made-up figure, a prompt with parts we did not count) and is left
# out, so that one such pair cannot shrink a model's window to nothing for good.
_MIN_RATIO, _MAX_RATIO = 0.2, 5.0


@dataclass(frozen=True, slots=True)
class Calibration:
    """`theirs = ceil(ratio * ours + overhead) + margin`, fitted from `samples` observations."""

    ratio: float = 1.0
    overhead: float = 0.0
    margin: int = 0
    samples: int = 0

    def provider_tokens(self, ours: int) -> int:
        """What the provider is expected to count (at most) for a prompt we count as `ours`."""
        return math.ceil(self.ratio * ours + self.overhead) + self.margin

    def our_budget(self, provider_budget: int) -> int:
        """The largest count of ours whose provider count stays within `provider_budget`."""
        room = provider_budget - self.overhead - self.margin
        return max(0, math.floor(room / self.ratio)) if room > 0 else 0

    def to_dict(self) -> JSONObject:
        return {
            "ratio": round(self.ratio, 4),
            "overhead": round(self.overhead, 1),
            "margin": self.margin,
            "samples": self.samples,
        }


# Before any observation: a tokenizer of another family counts up to ~1.25x tiktoken, and chat
# templates add a few dozen tokens. A refusal or the first answers correct this quickly.
UNCALIBRATED = Calibration(ratio=1.2, overhead=32.0, margin=0, samples=0)
# tiktoken is the model's own tokenizer (OpenAI families): only the framing can differ.
EXACT = Calibration(ratio=1.0, overhead=8.0, margin=0, samples=0)


def fit(observations: Sequence[tuple[int, int]], prior: Calibration = UNCALIBRATED) -> Calibration:
    """The calibration explaining `observations` (ours, theirs), conservative: the margin is
    the largest amount by which the fitted line undercounted any of them."""
    obs = [
        (float(o), float(t))
        for o, t in observations[-MAX_OBSERVATIONS:]
        if o > 0 and t > 0 and _MIN_RATIO <= t / o <= _MAX_RATIO
    ]
    if not obs:
        return prior
    xs = [o for o, _ in obs]
    ys = [t for _, t in obs]
    ratio, overhead = _line(xs, ys) if len(obs) >= 3 and max(xs) - min(xs) >= _MIN_SPREAD else (0.0, 0.0)
    if not _MIN_RATIO <= ratio <= _MAX_RATIO or overhead < 0:
        # No usable line (prompts too alike to tell a slope from an intercept, or one unlike
        # the others tilting it): least squares through the origin, the margin covering the
        # rest. Not the largest single ratio: a short prompt under a template's fixed system
        # prompt has one of 2-3, and every prompt was then planned at that.
        ratio, overhead = sum(x * y for x, y in zip(xs, ys, strict=True)) / sum(x * x for x in xs), 0.0
    worst = max(t - (ratio * o + overhead) for o, t in obs)
    margin = math.ceil(max(0.0, worst)) + _EXTRA_MARGIN
    return Calibration(ratio=ratio, overhead=overhead, margin=margin, samples=len(obs))


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        return 0.0, 0.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return slope, my - slope * mx
