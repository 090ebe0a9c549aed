"""The content rules of every way into a conversation (pure).

Chat completions' messages, Responses input and Conversations items are each checked here before
anything is stored, so the same content is taken or refused alike (SPEC 9): what is stored goes
back to the provider on every later turn, and what one way in refuses must not come in by another.

- An image is given by an http(s) URL with a host, or a `data:` URL: never `file:`, `ftp:`, a file
  id or an empty string (`invalid_image_url`).
- Chat's `image_url` is an object with a string `url` and, if any, a `detail` of `IMAGE_DETAILS`;
  a Responses `input_image` holds the URL itself in `image_url` (`invalid_image`).
- A model name holds no control character: C0, DEL or C1 (`invalid_model`).
- A message's `is_feedback` (the gateway's flag: forwarded once, never replayed) is a boolean.

A refusal is a 400 whose message starts with the place (`messages[0].content[1]: ...`), whose
`param` is the field that holds it (`messages[0].content`) and whose `code` names the rule.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from urllib.parse import urlsplit

from gateway.exceptions import InvalidRequest
from gateway.types import ImageURL

IMAGE_DETAILS = ("auto", "low", "high", "original")
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")
_IMAGE = "an image URL must be an http(s) URL or a data: URL"


def check_model(model: str, param: str = "model") -> str:
    """`model`, unless it holds a control character (logged, put in headers and file names)."""
    if _CONTROL.search(model):
        raise InvalidRequest(
            f"'{param}' must not contain control characters: {model!r}", param=param, code="invalid_model"
        )
    return model


def feedback_flag(message: object, at: str) -> bool:
    """Whether a message (a chat message, a Responses item, an Anthropic message) is feedback."""
    flag = message.get("is_feedback") if isinstance(message, dict) else None
    if flag is not None and not isinstance(flag, bool):
        raise InvalidRequest(f"{at}.is_feedback must be a boolean", param=f"{at}.is_feedback")
    return flag is True


def image_url(url: object, at: str, param: str) -> str:
    """An image's URL (a string, checked by `is_image_url`); `at` is the part that holds it."""
    if url is None:
        raise InvalidRequest(
            f"{at}: an image needs its URL (an http(s) URL or a data: URL)", param=param, code="invalid_image"
        )
    if not isinstance(url, str):
        raise InvalidRequest(f"{at}: {_IMAGE}, as a string", param=param, code="invalid_image")
    if not is_image_url(url):
        raise InvalidRequest(f"{at}: {_IMAGE}", param=param, code="invalid_image_url")
    return url


def is_image_url(url: str) -> bool:
    """Is this an http(s) URL with a host, or a data: URL with its data?"""
    scheme, colon, rest = url.partition(":")
    scheme = scheme.lower()
    if not colon:
        return False
    if scheme == "data":
        return "," in rest
    if scheme not in ("http", "https") or _CONTROL.search(url):
        return False
    try:
        return bool(urlsplit(url).hostname)
    except ValueError:  # (a broken IPv6 host, a port that is not a number)
        return False


def image_detail(detail: object, at: str, param: str) -> str | None:
    """An image's `detail`: None or one of `IMAGE_DETAILS`."""
    if detail is not None and (not isinstance(detail, str) or detail not in IMAGE_DETAILS):
        raise InvalidRequest(
            f"{at}: detail must be one of {', '.join(IMAGE_DETAILS)}", param=param, code="invalid_image"
        )
    return detail


def chat_image(image: object, at: str, param: str) -> ImageURL:
    """A chat `image_url` part's image: an object with a string `url` (and a known `detail`)."""
    if not isinstance(image, dict):
        raise InvalidRequest(
            f"{at}: image_url must be an object with a string url", param=param, code="invalid_image"
        )
    url = image_url(image.get("url"), at, param)
    detail = image_detail(image.get("detail"), at, param)
    return {"url": url} if detail is None else {"url": url, "detail": detail}


def check_messages(messages: Sequence[object], param: str = "messages") -> None:
    """Chat messages (objects, as the request schema checked them): every image part is checked."""
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        for k, part in enumerate(content):
            if isinstance(part, dict) and part.get("type") == "image_url":
                chat_image(part.get("image_url"), f"{param}[{i}].content[{k}]", f"{param}[{i}].content")
