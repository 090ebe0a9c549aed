"""Pure context functions: rebuild history, find what is new, repair tool calls."""

from gateway.context.history import (
    ConversationView,
    Message,
    Reconciled,
    Turn,
    clean_message,
    is_feedback,
    message_key,
    new_messages,
    rebuild_view,
    reconcile,
    repair_tool_calls,
    split_system,
)

__all__ = [
    "ConversationView",
    "Message",
    "Turn",
    "clean_message",
    "is_feedback",
    "message_key",
    "Reconciled",
    "new_messages",
    "reconcile",
    "rebuild_view",
    "repair_tool_calls",
    "split_system",
]
