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
from dataclasses import dataclass, replace

from gateway.types import JSONObject

# Newest (ours, theirs) pairs kept per (provider, model).
MAX_OBSERVATIONS = 64
# Below this spread of prompt sizes a slope cannot be told from an intercept: ratio only.
_MIN_SPREAD = 32
# Added to the worst miss seen: rounding, and prompts a little unlike the ones observed.
_EXTRA_MARGIN = 2
# Real tokenizers count a text within about half to three times tiktoken's count (and a chat
# template adds a few dozen tokens of its own): a reading outside is not a count of the same
# prompt (a provider error's made-up figure, the evaluated part only of a cached prompt, parts
# we did not count) and is not learned from, so that one such reading cannot shrink or widen a
# window for good.
MIN_RATIO, MAX_RATIO = 0.5, 3.0
TEMPLATE_ALLOWANCE = 64


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

    def never_below_ours(self) -> Calibration:
        """This calibration with a ratio of at least 1.

        The budgets it plans are never more of our tokens than the provider's budget (a configured
        window is kept in our count too).
        """
        return self if self.ratio >= 1 else replace(self, ratio=1.0)

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


def plausible(ours: int, theirs: int) -> bool:
    """Can `theirs` be a real tokenizer's count of a prompt we count as `ours`?"""
    return ours > 0 and MIN_RATIO * ours <= theirs <= MAX_RATIO * ours + TEMPLATE_ALLOWANCE


def fit(observations: Sequence[tuple[int, int]], prior: Calibration = UNCALIBRATED) -> Calibration:
    """The calibration explaining `observations` (ours, theirs), conservative.

    The margin is the largest amount by which the fitted line undercounted any of them.
    """
    obs = [(float(o), float(t)) for o, t in observations[-MAX_OBSERVATIONS:] if plausible(o, t)]
    if not obs:
        return prior
    xs = [o for o, _ in obs]
    ys = [t for _, t in obs]
    ratio, overhead = _line(xs, ys) if len(obs) >= 3 and max(xs) - min(xs) >= _MIN_SPREAD else (0.0, 0.0)
    if not MIN_RATIO <= ratio <= MAX_RATIO or overhead < 0:
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
