"""Token counting that works offline: tiktoken with its BPE files bundled in gateway/tokenizers.

`tiktoken.get_encoding()` would download its files on first use; we point TIKTOKEN_CACHE_DIR
at the bundled copies (so neither the network nor litellm is needed).
Models whose family is unknown are counted with `cl100k_base` (documented fallback).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:
    from tiktoken import Encoding

# OpenAI's per-message and per-request framing overheads (chat format).
TOKENS_PER_MESSAGE = 3
TOKENS_PER_REQUEST = 3


def bundled_tiktoken_dir() -> str | None:
    folder = Path(__file__).resolve().parent / "tokenizers"
    return str(folder) if folder.is_dir() else None


def _ensure_cache_dir() -> None:
    if "TIKTOKEN_CACHE_DIR" not in os.environ:
        folder = bundled_tiktoken_dir()
        if folder:
            os.environ["TIKTOKEN_CACHE_DIR"] = folder


def encoding_name_for(model: str) -> str:
    name = model.rsplit("/", 1)[-1].lower()
    if name.startswith(("gpt-4o", "gpt-4.1", "gpt-5", "o1", "o3", "o4", "chatgpt-4o")):
        return "o200k_base"
    return "cl100k_base"


_CACHE_DIR_LOCK = threading.Lock()


@lru_cache(maxsize=4)
def get_encoding(name: str) -> Encoding:
    _ensure_cache_dir()
    import tiktoken

    folder = bundled_tiktoken_dir()
    if folder is None or os.environ.get("TIKTOKEN_CACHE_DIR") == folder:
        encoding = tiktoken.get_encoding(name)
    else:
        # The user's own TIKTOKEN_CACHE_DIR may lack these files (tiktoken would then download
        # them: offline, every turn failed): the bundled copies are read, and the variable is
        # left as it was for anything else in the process.
        with _CACHE_DIR_LOCK:
            before = os.environ["TIKTOKEN_CACHE_DIR"]  # (set: `_ensure_cache_dir` sets it when unset)
            os.environ["TIKTOKEN_CACHE_DIR"] = folder
            try:
                encoding = tiktoken.get_encoding(name)
            finally:
                os.environ["TIKTOKEN_CACHE_DIR"] = before
    # The Rust core keeps its own copy of the BPE ranks; the Python-side dict (~16 MB for
    # cl100k_base) is only used by token_byte_values(), which the gateway never calls.
    if isinstance(getattr(encoding, "_mergeable_ranks", None), dict):
        encoding._mergeable_ranks = {}
    return encoding


def count_text(text: str, model: str = "") -> int:
    return len(get_encoding(encoding_name_for(model)).encode(text, disallowed_special=()))


def count_message(message: Mapping[str, object], model: str = "") -> int:
    """Tokens a message costs in a chat request: its text fields plus framing."""
    return _message_counter(encoding_name_for(model))(message)


# Short strings (roles, names, one-word answers) are counted once per encoding.
_SHORT = 32
_SHORT_KEPT = 4096


@lru_cache(maxsize=4)
def _message_counter(name: str) -> Callable[[Mapping[str, object]], int]:
    encode = get_encoding(name).encode_ordinary  # = encode(text, disallowed_special=())
    short: dict[str, int] = {}

    def count(message: Mapping[str, object]) -> int:
        total = TOKENS_PER_MESSAGE
        for key, value in message.items():
            if key == "is_feedback" or value is None:
                continue
            if not isinstance(value, str):
                total += len(encode(orjson.dumps(value).decode()))
            elif len(value) > _SHORT:
                total += len(encode(value))
            else:
                tokens = short.get(value)
                if tokens is None:
                    tokens = len(encode(value))
                    if len(short) < _SHORT_KEPT:
                        short[value] = tokens
                total += tokens
            if key == "name":
                total += 1
        return total

    return count


def truncate_text(text: str, max_tokens: int, model: str = "") -> str:
    """`text` cut to at most `max_tokens` tokens (on a token boundary)."""
    enc = get_encoding(encoding_name_for(model))
    ids = enc.encode(text, disallowed_special=())
    if len(ids) <= max_tokens:
        return text
    return str(enc.decode(ids[:max_tokens]))


def counter_for(model: str) -> tuple[str, Callable[[Mapping[str, object]], int]]:
    """(encoding name, count_message bound to it) for a model.

    It loads the encoding: call it once the tokenizers are warm, never on the event loop before.
    """
    name = encoding_name_for(model)
    return name, _message_counter(name)


def release_free_memory(*, collect: bool = True) -> None:
    """Give freed heap back to the OS after loading tokenizers (glibc only; else a no-op).

    `collect=False` when a full collection has just run.
    """
    import ctypes
    import gc

    if collect:
        gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
