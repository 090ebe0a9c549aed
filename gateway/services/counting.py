"""Counting a turn before it is sent (`POST /v1/responses/input_tokens`).

The prompt the turn's window would make, in the provider's units where the gateway knows them,
and the branch a turn on an earlier response would plan on, read without making it.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from gateway.context import ConversationView
from gateway.context.calibration import Calibration
from gateway.services.planning import ContextPlan
from gateway.services.tail import Skipped, apply_entries
from gateway.services.turn import branch_at
from gateway.store.base import IndexEntry, Store


@dataclass(frozen=True, slots=True)
class PromptCount:
    """A turn's prompt, counted: `input_tokens` as `counted_by` says, and the plan it counts."""

    input_tokens: int
    # "server": the server's own count of the prompt (llama.cpp, vLLM); "calibration": the
    # gateway's count mapped to the provider's by what its answers taught; "gateway": the
    # gateway's own count (tiktoken: exact for OpenAI's models; nothing learned yet elsewhere).
    counted_by: str
    plan: ContextPlan


def prompt_count(plan: ContextPlan, calibration: Calibration) -> PromptCount:
    """The plan's prompt in the provider's units.

    The server's count where it gave one, else the window's `tokens.total` through the
    calibration's best estimate once it has learned from an answer (`ratio`, `overhead`; its
    margin covers the worst miss and is no part of an estimate).
    """
    if plan.server_tokens is not None:
        return PromptCount(plan.server_tokens, "server", plan)
    ours = plan.window.total_tokens
    if calibration.samples:
        return PromptCount(replace(calibration, margin=0).provider_tokens(ours), "calibration", plan)
    return PromptCount(ours, "gateway", plan)


async def branch_view(store: Store, cid: str, previous: str, skipped: Skipped) -> ConversationView | None:
    """The conversation a turn continuing `previous` plans on when that is no longer the newest response.

    It is the branch `turn.lock_conversation` would make at it (the index up to it, then the
    deletions made since of what it shares), read without making it. None when `previous` is the
    newest: the turn continues the conversation itself.
    """
    index = await store.read_index(cid)
    branch = branch_at(index, previous)
    if branch is None:
        return None
    prefix = [e for e in index[: branch.end] if isinstance(e, str)]
    records = iter(await store.read_turns(prefix))
    entries = [
        IndexEntry(e, None, next(records)) if isinstance(e, str) else IndexEntry(None, e, [])
        for e in [*index[: branch.end], *branch.deletions]
    ]
    view = ConversationView()
    apply_entries(view, cid, entries, skipped)
    return view
