"""A conversation-continuity gateway for LLM providers.

An OpenAI-compatible proxy that owns the conversation.
"""

__version__ = "0.1.0"
