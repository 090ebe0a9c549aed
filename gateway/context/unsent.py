"""Why stored messages no longer reach the model: one reading of a view, for every display.

`gateway show` and the inspector both mark each stored message the model is not given any more,
and say why, from this one reading instead of working it out each on its own.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.context.history import ConversationView, is_feedback, item_key
from gateway.types import Message

FEEDBACK = "feedback: not replayed"
DELETED = "deleted"
CALL_GONE = "no tool call left to answer (deleted, or answered before it came)"
BRANCHED = "left behind by a branch"
RESET = "before a reset of the conversation"
REPLACED = "replaced by a later system prompt"


class Unsent:
    """The messages of a view's stored turns that the model is no longer given, with the reason.

    A message is given when it is in the view's history and survives the tool-call repair (a
    result whose call was deleted, or answered before it came, is dropped); a turn's system
    prompt is given while no later turn replaced it and it was not deleted.
    """

    def __init__(self, view: ConversationView) -> None:
        self.view = view
        self.sent = view.sent_items()
        self.in_history = set(zip(view.history_owner, view.history_pos, strict=True))

    def why(self, response_id: str, position: int, message: Message | None = None) -> str | None:
        """Why the message at `position` of a turn (input first, then the answer) is not given.

        None: it is. `message`, when known, tells feedback apart."""
        if (response_id, position) in self.sent:
            return None
        if message is not None and is_feedback(message):
            return FEEDBACK
        if item_key(response_id, position) in self.view.deleted_items:
            return DELETED
        if (response_id, position) in self.in_history:
            return CALL_GONE
        return RESET if response_id in self.view.reset_away else BRANCHED

    def parts(self, response_id: str, position: int) -> tuple[list[str], Message | None]:
        """What of a message still given was deleted (an answer's text, some of its calls), and
        the message as it is given now ([] and None: nothing was)."""
        deleted = self.view.deleted_parts.get(item_key(response_id, position))
        if not deleted or (response_id, position) not in self.sent:
            return [], None
        pairs = zip(self.view.history_owner, self.view.history_pos, self.view.history, strict=True)
        given = next((m for owner, pos, m in pairs if owner == response_id and pos == position), None)
        return deleted, given

    def of_turn(
        self,
        response_id: str,
        input: Sequence[Message],
        output: Message | None,
        system: Sequence[Message] | None = None,
    ) -> dict[int, str]:
        """Every position of a turn's messages and `system` prompt the model is not given, with why.

        A turn's messages are its `input`, then its `output` answer; its `system` prompt's are
        -1, -2, ... The answer to feedback alone is feedback too: such a turn is never replayed."""
        messages = [*input, *([output] if output is not None else [])]
        out = {
            position: reason
            for position, message in enumerate(messages)
            if (reason := self.why(response_id, position, message)) is not None
        }
        if output is not None and input and all(is_feedback(m) for m in input):
            out[len(input)] = FEEDBACK
        if system and self.view.system_owner != response_id:
            key = item_key(response_id, -1)
            why = REPLACED
            if key in self.view.deleted_items:
                why = DELETED
            elif key in self.view.reset_away:
                why = RESET
            out.update({-(i + 1): why for i in range(len(system))})
        return out
