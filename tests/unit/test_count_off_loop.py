"""Large text is counted in a worker thread, off the event loop; small text on it."""

from __future__ import annotations

import asyncio
import threading

from gateway.services.planning import COUNT_OFF_LOOP_CHARS, off_loop_if_large
from gateway.tokens import count_message


async def counted_where(text: str) -> tuple[int, bool]:
    """The count of one message of `text`, and whether it ran on the loop's thread."""
    loop_thread = threading.get_ident()
    message = {"role": "assistant", "content": text}
    on_loop: list[bool] = []

    def work() -> int:
        on_loop.append(threading.get_ident() == loop_thread)
        return count_message(message, "gpt-4o")

    return await off_loop_if_large([message], work), on_loop[0]


async def test_an_answer_of_a_few_thousand_characters_is_counted_off_the_loop() -> None:
    long_text = "A paced answer, a few words a chunk. " * 150  # 5,550 characters
    assert len(long_text) > COUNT_OFF_LOOP_CHARS
    tokens, on_loop = await counted_where(long_text)
    assert not on_loop
    assert tokens == count_message({"role": "assistant", "content": long_text}, "gpt-4o")


async def test_a_short_text_is_counted_on_the_loop() -> None:
    tokens, on_loop = await counted_where("Hello there.")
    assert on_loop and tokens > 0


async def test_other_turns_run_while_a_long_text_is_counted() -> None:
    """The loop is not held: a task scheduled meanwhile runs before the count is back."""
    ran: list[str] = []

    async def meanwhile() -> None:
        ran.append("other")

    text = "word " * 40_000  # 200,000 characters: milliseconds of counting
    other = asyncio.ensure_future(meanwhile())
    await counted_where(text)
    ran.append("counted")
    await other
    assert ran == ["other", "counted"]
