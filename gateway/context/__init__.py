"""Pure context functions: rebuild history, find what is new, repair tool calls."""

from gateway.context.history import (
    ConversationView,
    Turn,
    clean_message,
    is_feedback,
    message_key,
    rebuild_view,
    repair_tool_calls,
    split_system,
)
from gateway.context.reconcile import Reconciled, new_messages, reconcile
from gateway.types import Message

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
