"""Learning from what the provider reported of a prompt.

The calibration of the gateway's count against the provider's, and a provider that silently cut
a prompt (Ollama's `num_ctx`).
"""

from __future__ import annotations

import logging

import orjson

from gateway.context.calibration import UNCALIBRATED
from gateway.context.window import Window
from gateway.services.models import ModelFacts, WindowFacts
from gateway.store.base import LRU
from gateway.types import Record
from gateway.upstream import Route

log = logging.getLogger("gateway.services")

# A provider reporting fewer prompt tokens than this share of ours probably cut the prompt.
_TRUNCATION_RATIO = 0.7
_UNCALIBRATED_TRUNCATION_RATIO = 0.5
_TRUNCATION_MIN_TOKENS = 256
# Conversations whose suspected truncation was logged (the newest this many are remembered).
WARNED_LIMIT = 4096


class UsageLearning:
    """Learns from each answered turn's usage, for the model facts every turn plans with."""

    def __init__(self, facts: ModelFacts) -> None:
        self.facts = facts
        # Conversations already warned about (the newest WARNED_LIMIT: bounded memory).
        self._warned_truncation: LRU[str | None, bool] = LRU(WARNED_LIMIT)

    def learn(
        self,
        window: Window,
        facts: WindowFacts | None,
        route: Route,
        record: Record,
        cid: str | None,
        rid: str,
    ) -> bool:
        """Calibrate counting from the provider's count of the whole prompt; flag a silent cut.

        The whole prompt is the response's `cache` figures: cached and uncached tokens together,
        where a provider reports them apart, as Anthropic does. A provider that silently dropped
        part of the prompt (Ollama's num_ctx) is flagged: it saw under 70% of what it should have.
        """
        cache = record.get("cache")
        if not isinstance(cache, dict):
            return False
        theirs = cache.get("prompt_tokens")
        ours = window.total_tokens
        if not isinstance(theirs, int) or isinstance(theirs, bool) or theirs <= 0:
            return False
        # (what was learned: a plan's may keep a configured window in our count, ratio 1)
        calibration = self.facts.calibration(route) if facts is not None else None
        if calibration is not None and calibration.samples > 0:
            expected, ratio = calibration.ratio * ours + calibration.overhead, _TRUNCATION_RATIO
        else:
            # Not calibrated yet: a provider may simply count fewer tokens than we do (a larger
            # vocabulary, a rough count), so only a cut to under half is taken for truncation.
            expected, ratio = float(ours), _UNCALIBRATED_TRUNCATION_RATIO
        if ours < _TRUNCATION_MIN_TOKENS or theirs >= expected * ratio:
            prior = calibration or UNCALIBRATED
            if theirs < prior.ratio * ours + prior.overhead and _has_tools(window):
                # Chat templates render tool definitions and calls their own way, or not at all
                # (SmolLM2's leaves them out): such a prompt may teach that the model counts
                # more, never that it counts less (it once halved the planned ratio).
                return False
            self.facts.observe(route, ours, theirs)
            return False
        if facts is not None and not facts.cuts_silently:
            # llama.cpp and vLLM refuse what does not fit: a low count is their chat template's
            # (one that leaves `tools` out), not a cut. Not learned from: it would understate.
            return False
        record["upstream_truncation_suspected"] = {"prompt_tokens": theirs, "our_count": ours}
        if route.upstream.reports_real_usage:
            self.facts.truncated(route, theirs)
        if self._warned_truncation.get(cid):
            return True  # recorded on every response, logged once per conversation
        self._warned_truncation[cid] = True
        log.warning(
            orjson.dumps(
                {
                    "event": "upstream_truncation_suspected",
                    "response_id": rid,
                    "conversation_id": cid,
                    "provider": route.provider,
                    "prompt_tokens": theirs,
                    "our_count": ours,
                }
            ).decode()
        )
        return True


def _has_tools(window: Window) -> bool:
    """Did the prompt carry tool definitions, tool calls or tool results?"""
    return bool(window.tokens.get("tools")) or any(
        m.get("tool_calls") or m.get("role") == "tool" for m in window.messages
    )
