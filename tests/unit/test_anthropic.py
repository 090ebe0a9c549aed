"""Anthropic's Messages API <-> chat turns (gateway.context.anthropic), both ways: system blocks,
images, tool_use / tool_result, tools and tool_choice, answers as content blocks, stop reasons,
usage, the event stream, errors; and the round trip a resending client depends on."""

from __future__ import annotations

import json
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.context import Message, message_key
from gateway.context.anthropic import (
    BlockEvents,
    chat_messages,
    chat_request,
    chat_tool_choice,
    chat_tools,
    content_blocks,
    error_body,
    message_object,
    message_usage,
    stop_reason,
    tool_input,
)
from gateway.context.tools import repair_tool_calls
from gateway.exceptions import InvalidRequest

PNG = "iVBORw0KGgo="


def text(value: str) -> dict[str, Any]:
    return {"type": "text", "text": value}


def tool_use(call_id: str, name: str = "get_weather", **arguments: Any) -> dict[str, Any]:
    return {"type": "tool_use", "id": call_id, "name": name, "input": arguments}


def refused(system: object = None, messages: object = None, **bad: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        chat_messages(system, messages if messages is not None else [bad])
    return caught.value


# -- requests ------------------------------------------------------------------------------------


def test_system_as_a_string_or_text_blocks_is_the_leading_system_message() -> None:
    hi = [{"role": "user", "content": "hi"}]
    assert chat_messages("Be brief.", hi)[0] == {"role": "system", "content": "Be brief."}
    blocks = [text("Be brief."), {**text("Answer in French."), "cache_control": {"type": "ephemeral"}}]
    assert chat_messages(blocks, hi)[0] == {"role": "system", "content": "Be brief.\n\nAnswer in French."}
    assert chat_messages(None, hi) == chat_messages("", hi) == [{"role": "user", "content": "hi"}]
    assert refused([{"type": "image"}], hi).param == "system"
    assert refused(3, hi).param == "system"


def test_user_content_as_a_string_or_blocks() -> None:
    one = chat_messages(None, [{"role": "user", "content": [text("hello")]}])
    assert one == [{"role": "user", "content": "hello"}]  # one text block: a string, as chat clients send
    two = chat_messages(None, [{"role": "user", "content": [text("a"), text("b")]}])
    assert two == [{"role": "user", "content": [text("a"), text("b")]}]
    assert message_key(two[0]) == message_key({"role": "user", "content": "ab"})


def test_images_by_base64_and_by_url_are_image_url_parts() -> None:
    content = [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/cat.jpg"}},
        text("what is this?"),
    ]
    [message] = chat_messages(None, [{"role": "user", "content": content}])
    assert message == {
        "role": "user",
        "content": [
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
            text("what is this?"),
        ],
    }


def test_images_keep_the_content_rules_of_every_way_in() -> None:
    def image(source: object) -> dict[str, Any]:
        return {"role": "user", "content": [{"type": "image", "source": source}]}

    bad_url = refused(messages=[image({"type": "url", "url": "file:///etc/passwd"})])
    assert (bad_url.code, bad_url.param) == ("invalid_image_url", "messages[0].content")
    assert "messages[0].content[0]" in bad_url.message
    assert refused(messages=[image({"type": "file", "file_id": "f"})]).code == "invalid_image"
    assert refused(messages=[image({"type": "base64", "data": PNG})]).param == "messages[0].content"
    assert refused(messages=[image("https://example.com/a.png")]).code == "invalid_image"


def test_documents_pdf_as_a_file_part_plain_text_as_text() -> None:
    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBE"}}
    plain = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "notes"}}
    [message] = chat_messages(None, [{"role": "user", "content": [{**pdf, "title": "a.pdf"}, plain]}])
    assert message["content"] == [
        {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBE", "filename": "a.pdf"}},
        text("notes"),
    ]
    url = {"type": "document", "source": {"type": "url", "url": "https://example.com/a.pdf"}}
    assert refused(messages=[{"role": "user", "content": [url]}]).code == "invalid_document"


def test_tool_use_blocks_are_the_assistant_messages_tool_calls() -> None:
    content = [
        {"type": "thinking", "thinking": "hmm", "signature": "s"},
        text("Let me look."),
        tool_use("toolu_1", city="Paris"),
        tool_use("toolu_2", "get_time", tz="Europe/Paris"),
    ]
    [message] = chat_messages(None, [{"role": "assistant", "content": content}])
    assert message == {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "toolu_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'},
            },
            {
                "id": "toolu_2",
                "type": "function",
                "function": {"name": "get_time", "arguments": '{"tz":"Europe/Paris"}'},
            },
        ],
    }
    [only_calls] = chat_messages(None, [{"role": "assistant", "content": [tool_use("t")]}])
    assert only_calls["content"] is None
    twice = refused(messages=[{"role": "assistant", "content": [tool_use("t"), tool_use("t")]}])
    assert "two tool_use blocks with one id" in twice.message
    assert refused(
        messages=[{"role": "assistant", "content": [{**tool_use("t"), "input": "x"}]}]
    ).message == ("messages[0].content[0].input must be an object")
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}}
    assert "assistant message" in refused(messages=[{"role": "assistant", "content": [image]}]).message


def test_tool_results_are_tool_messages_ahead_of_the_rest_of_the_user_message() -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}}
    content = [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny, 21C"},
        {"type": "tool_result", "tool_use_id": "toolu_2", "content": [text("12:00"), text("CEST"), image]},
        {"type": "tool_result", "tool_use_id": "toolu_3", "content": "no such city", "is_error": True},
        {"type": "tool_result", "tool_use_id": "toolu_4"},
        text("and tomorrow?"),
    ]
    assert chat_messages(None, [{"role": "user", "content": content}]) == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21C"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "12:00\nCEST"},
        {"role": "tool", "tool_call_id": "toolu_3", "content": "Error: no such city"},
        {"role": "tool", "tool_call_id": "toolu_4", "content": ""},
        {
            "role": "user",
            "content": [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}},
                text("and tomorrow?"),
            ],
        },
    ]
    only = chat_messages(None, [{"role": "user", "content": content[:1]}])
    assert only == [{"role": "tool", "tool_call_id": "toolu_1", "content": "sunny, 21C"}]
    no_id = {"type": "tool_result", "tool_use_id": "", "content": "x"}
    assert refused(messages=[{"role": "user", "content": [no_id]}]).message.endswith(
        "must be a non-empty string"
    )
    flag = {"type": "tool_result", "tool_use_id": "t", "is_error": "yes"}
    assert refused(messages=[{"role": "user", "content": [flag]}]).message.endswith(
        "is_error must be a boolean"
    )


def test_an_image_of_a_type_anthropic_does_not_take_is_a_400() -> None:
    """`text/html` was sent on as a `data:text/html;base64,...` image, stored and replayed."""
    html = {"type": "image", "source": {"type": "base64", "media_type": "text/html", "data": PNG}}
    refusal = refused(messages=[{"role": "user", "content": [html]}])
    assert "media_type must be one of image/jpeg, image/png, image/gif, image/webp" in refusal.message
    for media in ("image/jpeg", "image/png", "image/gif", "image/webp"):
        ok = {"type": "image", "source": {"type": "base64", "media_type": media, "data": PNG}}
        assert chat_messages(None, [{"role": "user", "content": [ok]}])


def test_a_tool_result_may_hold_documents_and_search_results() -> None:
    """Both are in the SDK's ToolResultBlockParam; they were a 400."""
    pdf = {
        "type": "document",
        "source": {"type": "base64", "media_type": "application/pdf", "data": "JVBERi0="},
    }
    plain = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "page one"}}
    found = {
        "type": "search_result",
        "title": "Doc",
        "source": "https://example.com",
        "content": [text("hit")],
    }
    content = [{"type": "tool_result", "tool_use_id": "t1", "content": [plain, found, pdf]}]
    assert chat_messages(None, [{"role": "user", "content": content}]) == [
        {"role": "tool", "tool_call_id": "t1", "content": "page one\nDoc\nhttps://example.com\nhit"},
        {
            "role": "user",
            "content": [
                {
                    "type": "file",
                    "file": {"file_data": "data:application/pdf;base64,JVBERi0=", "filename": "document.pdf"},
                }
            ],
        },
    ]
    odd = {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "tool_use", "id": "x"}]}
    assert (
        "holds text, image, document and search_result blocks"
        in refused(messages=[{"role": "user", "content": [odd]}]).message
    )


def test_a_tool_round_trip_keeps_the_order_providers_require() -> None:
    history = [
        {"role": "user", "content": "weather in Paris and the time?"},
        {
            "role": "assistant",
            "content": [tool_use("toolu_1", city="Paris"), tool_use("toolu_2", "get_time")],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "tool_result", "tool_use_id": "toolu_2", "content": "noon"},
            ],
        },
    ]
    messages = chat_messages(None, history)
    assert [m["role"] for m in messages] == ["user", "assistant", "tool", "tool"]
    assert repair_tool_calls(messages) == messages  # nothing to repair: every call answered


def test_bad_messages_name_their_place() -> None:
    assert refused(messages=[]).param == "messages"
    assert refused(role="system", content="x").param == "messages[0].role"
    assert refused(role="user", content=3).param == "messages[0].content"
    assert refused(role="user", content=[]).message == "messages[0].content must not be empty"
    assert refused(role="user", content=[{"type": "video"}]).message == (
        "messages[0].content[0]: unsupported content block type 'video'"
    )
    assert refused(role="user", content=["hi"]).param == "messages[0].content"
    assert refused(role="user", content=[{"type": "text", "text": 3}]).message == (
        "messages[0].content[0].text must be a string"
    )


def test_tools_and_tool_choice() -> None:
    tools = [
        {"name": "get_weather", "description": "Weather", "input_schema": {"type": "object"}},
        {"name": "noop", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}},
    ]
    assert chat_tools(tools) == [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}},
        },
        {"type": "function", "function": {"name": "noop", "parameters": {"type": "object"}}},
    ]
    assert chat_tools(None) is None
    server_tool = [{"type": "web_search_20250305", "name": "web_search"}]
    with pytest.raises(InvalidRequest, match="only client tools"):
        chat_tools(server_tool)
    with pytest.raises(InvalidRequest, match="input_schema"):
        chat_tools([{"name": "x"}])
    assert chat_tool_choice({"type": "auto"}) == ("auto", None)
    assert chat_tool_choice({"type": "any", "disable_parallel_tool_use": True}) == ("required", False)
    assert chat_tool_choice({"type": "none"}) == ("none", None)
    assert chat_tool_choice({"type": "tool", "name": "get_weather"}) == (
        {"type": "function", "function": {"name": "get_weather"}},
        None,
    )
    for bad in ({"type": "tool"}, {"type": "sometimes"}, "auto"):
        with pytest.raises(InvalidRequest):
            chat_tool_choice(bad)


def test_chat_request_passes_on_what_a_chat_provider_takes() -> None:
    body = {
        "model": "mock/m",
        "max_tokens": 256,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "hi"}],
        "stop_sequences": ["\n\nHuman:"],
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 5,  # (no chat counterpart: left out)
        "metadata": {"user_id": "u-1"},
        "stream": True,
        "tools": [{"name": "t", "input_schema": {"type": "object"}}],
        "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 1024},
    }
    assert chat_request(body, cap="max_completion_tokens") == {
        "model": "mock/m",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        "max_completion_tokens": 256,
        "stream": True,
        "stream_options": {"include_usage": True},
        "tools": [{"type": "function", "function": {"name": "t", "parameters": {"type": "object"}}}],
        "parallel_tool_calls": False,
        "tool_choice": "auto",
        "stop": ["\n\nHuman:"],
        "temperature": 0.2,
        "top_p": 0.9,
        "user": "u-1",
    }
    # (a tool_choice without tools is not passed on: chat providers refuse it)
    no_tools = {"tool_choice": {"type": "any", "disable_parallel_tool_use": True}}
    plain = chat_request(
        {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], **no_tools},
        cap="max_tokens",
    )
    assert plain == {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}


def test_structured_outputs_strict_tools_and_effort_are_passed_on() -> None:
    """`output_config` (the SDK's `messages.parse(output_format=...)`) and a tool's `strict` were
    dropped: the model was not held to the schema, and nothing said so."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    body = {
        "model": "m",
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "x"}],
        "output_config": {"format": {"type": "json_schema", "schema": schema}, "effort": "max"},
        "tools": [{"name": "t", "input_schema": {"type": "object"}, "strict": True}],
    }
    chat = chat_request(body, cap="max_tokens")
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema, "strict": True},
    }
    assert chat["reasoning_effort"] == "high" and chat["tools"][0]["function"]["strict"] is True
    earlier = chat_request(
        {**body, "output_config": None, "output_format": {"type": "json_schema", "schema": schema}},
        cap="max_tokens",
    )
    assert earlier["response_format"]["json_schema"]["schema"] == schema
    for bad in ({"format": {"type": "text"}}, {"effort": "extreme"}, "fast"):
        with pytest.raises(InvalidRequest):
            chat_request({**body, "output_config": bad}, cap="max_tokens")


# -- answers -------------------------------------------------------------------------------------


def test_an_answer_is_content_blocks() -> None:
    answer: Message = {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            },
            {"id": "call_2", "type": "function", "function": {"name": "broken", "arguments": "not json"}},
        ],
    }
    assert content_blocks(answer) == [
        text("Let me look."),
        {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}},
        {"type": "tool_use", "id": "call_2", "name": "broken", "input": {}},
    ]
    assert content_blocks({"role": "assistant", "content": ""}) == []
    assert content_blocks({"role": "assistant", "content": None, "refusal": "I can't."}) == [text("I can't.")]
    assert tool_input("[1, 2]") == tool_input(None) == {}


def test_stop_reasons() -> None:
    assert stop_reason("stop", calls=False) == ("end_turn", None)
    assert stop_reason(None, calls=False) == ("end_turn", None)
    assert stop_reason("length", calls=False) == ("max_tokens", None)
    assert stop_reason("tool_calls", calls=True) == ("tool_use", None)
    assert stop_reason("stop", calls=True) == ("tool_use", None)  # (a server that says "stop" with calls)
    assert stop_reason("tool_calls", calls=False) == ("end_turn", None)
    assert stop_reason("content_filter", calls=False) == ("refusal", None)
    assert stop_reason("stop", calls=False, matched="END") == ("stop_sequence", "END")


def test_message_object() -> None:
    usage = message_usage({"prompt_tokens": 10, "completion_tokens": 3}, None)
    message = message_object(
        message_id="mock-m-0123456789ab",
        model="mock/m",
        message={"role": "assistant", "content": "Hi."},
        finish_reason="stop",
        usage=usage,
    )
    assert message == {
        "id": "mock-m-0123456789ab",
        "type": "message",
        "role": "assistant",
        "model": "mock/m",
        "content": [text("Hi.")],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 10,
            "output_tokens": 3,
            "cache_read_input_tokens": 0,
            "cache_creation_input_tokens": 0,
        },
    }


def test_usage_is_split_as_anthropic_splits_it() -> None:
    # OpenAI: prompt_tokens is the whole prompt, cached_tokens part of it.
    cache = {"prompt_tokens": 1000, "cached_tokens": 800, "source": "usage"}
    openai = message_usage({"prompt_tokens": 1000, "completion_tokens": 5}, cache)
    assert openai == {
        "input_tokens": 200,
        "output_tokens": 5,
        "cache_read_input_tokens": 800,
        "cache_creation_input_tokens": 0,
    }
    # Anthropic through litellm: reads and writes reported apart.
    written = {
        "prompt_tokens": 1500,
        "cached_tokens": 1000,
        "cache_creation_tokens": 400,
        "source": "anthropic",
    }
    assert message_usage({"completion_tokens": 7}, written)["input_tokens"] == 100
    # Nothing reported: the gateway's own counts.
    assert message_usage(None, None, output_tokens=4, estimate=30) == {
        "input_tokens": 30,
        "output_tokens": 4,
        "cache_read_input_tokens": 0,
        "cache_creation_input_tokens": 0,
    }


# -- the round trip a resending client depends on ------------------------------------------------

ARGUMENTS = st.dictionaries(
    st.text(min_size=1, max_size=8),
    st.one_of(st.integers(-99, 99), st.text(max_size=8), st.booleans()),
    max_size=3,
)
CALLS = st.lists(
    st.tuples(
        st.from_regex(r"call_[a-z0-9]{1,8}", fullmatch=True),
        st.from_regex(r"[a-z_]{1,12}", fullmatch=True),
        ARGUMENTS,
    ),
    max_size=3,
    unique_by=lambda call: call[0],
)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=40), CALLS, st.booleans())
def test_an_answer_resent_as_the_client_got_it_is_the_stored_answer(
    content: str, calls: list[tuple[str, str, dict[str, Any]]], spaced: bool
) -> None:
    """The SDK's `{"role": "assistant", "content": message.content}` comes back as the message
    the gateway stored: a resending client's overlap is recognised, not stored again."""
    stored: Message = {"role": "assistant", "content": content if content or not calls else None}
    if calls:
        # (a provider spaces its JSON as it likes; the client's `input` is compact again)
        dumps = (
            (lambda v: json.dumps(v, separators=(", ", ": ")))
            if spaced
            else (lambda v: orjson.dumps(v).decode())
        )
        stored["tool_calls"] = [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": dumps(arguments)}}
            for call_id, name, arguments in calls
        ]
    [resent] = chat_messages(None, [{"role": "assistant", "content": content_blocks(stored)}])
    assert message_key(resent) == message_key(stored)


# -- streams -------------------------------------------------------------------------------------


def delta(**fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": None}]}


def piece(index: int, *, id: str | None = None, name: str | None = None, args: str = "") -> dict[str, Any]:
    function: dict[str, str] = {"arguments": args}
    if name is not None:
        function["name"] = name
    call: dict[str, Any] = {"index": index, "function": function}
    if id is not None:
        call["id"] = id
    return delta(tool_calls=[call])


def test_a_stream_of_text_then_tool_calls_is_a_block_each() -> None:
    blocks = BlockEvents()
    chunks = [
        delta(role="assistant", content=""),
        delta(content="Let me "),
        delta(content="look."),
        piece(0, id="call_a", name="get_weather", args='{"ci'),
        piece(0, args='ty": "Paris"}'),
        piece(1, id="call_b", name="get_time"),
        piece(0, args=" "),  # (whitespace after the first call's whole JSON: nothing to send)
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}},
    ]
    events = [event for chunk in chunks for event in blocks.feed(chunk)] + blocks.close()
    assert events == [
        {"type": "content_block_start", "index": 0, "content_block": text("")},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Let me "}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "look."}},
        {"type": "content_block_stop", "index": 0},
        {
            "type": "content_block_start",
            "index": 1,
            "content_block": {"type": "tool_use", "id": "call_a", "name": "get_weather", "input": {}},
        },
        {  # (its input whole, just before its block stops)
            "type": "content_block_delta",
            "index": 1,
            "delta": {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'},
        },
        {"type": "content_block_stop", "index": 1},
        {
            "type": "content_block_start",
            "index": 2,
            "content_block": {"type": "tool_use", "id": "call_b", "name": "get_time", "input": {}},
        },
        {"type": "content_block_stop", "index": 2},
    ]
    assert blocks.close() == []


def test_interleaved_parallel_calls_each_have_their_deltas_between_start_and_stop() -> None:
    """A provider interleaving two calls had the first call's arguments sent after its block's
    stop: a client taking a call as done at `content_block_stop` got `{}` for its input."""
    blocks = BlockEvents()
    chunks = [
        piece(0, id="call_a", name="get_weather"),
        piece(1, id="call_b", name="get_time", args='{"tz"'),
        piece(0, args='{"city": '),
        piece(2, id="call_c", name="get_date"),
        piece(1, args=': "UTC"}'),
        piece(0, args='"Paris"}'),
        piece(2, args="{}"),
    ]
    events = [event for chunk in chunks for event in blocks.feed(chunk)] + blocks.close()
    stopped: set[int] = set()
    inputs: dict[int, str] = {}
    for event in events:
        index = event["index"]
        assert index not in stopped, event  # nothing of a block after its stop
        if event["type"] == "content_block_stop":
            stopped.add(index)
        elif event["type"] == "content_block_delta":
            inputs[index] = inputs.get(index, "") + event["delta"]["partial_json"]
    starts = [e["content_block"]["id"] for e in events if e["type"] == "content_block_start"]
    assert starts == ["call_a", "call_b", "call_c"] and stopped == {0, 1, 2}
    assert inputs == {0: '{"city": "Paris"}', 1: '{"tz": "UTC"}', 2: "{}"}


def test_the_stop_string_a_provider_names_is_kept() -> None:
    blocks = BlockEvents()
    blocks.feed({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop", "stop_reason": "END"}]})
    assert blocks.provider_stop == "END"


# -- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (408, "invalid_request_error"),
        (409, "invalid_request_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (500, "api_error"),
        (502, "api_error"),
        (503, "overloaded_error"),
        (504, "timeout_error"),
    ],
)
def test_errors_in_anthropics_shape(status: int, kind: str) -> None:
    assert error_body(status, "why") == {"type": "error", "error": {"type": kind, "message": "why"}}


def test_a_calls_arguments_that_are_no_json_object_are_streamed_as_the_whole_answer_has_them() -> None:
    """Streamed piece by piece, `{not json` made the SDK raise "Unable to parse tool parameter
    JSON" before the application had the message; a whole answer says `input: {}`."""
    blocks = BlockEvents()
    chunks = [
        piece(0, id="call_a", name="f", args="{not "),
        piece(0, args="json"),
        piece(1, id="b", name="g", args="[1]"),
    ]
    events = [event for chunk in chunks for event in blocks.feed(chunk)] + blocks.close()
    inputs = [e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"]
    assert inputs == ["{}", "{}"]  # (a list is no object either)
    assert [e["type"] for e in events].count("content_block_stop") == 2
