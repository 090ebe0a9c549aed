"""The pure part of compaction: the reference in `encrypted_content`, and what a compaction
covers of a conversation."""

from __future__ import annotations

import base64

import pytest

from gateway.context import rebuild_view
from gateway.context.compaction import (
    ID_BYTES,
    SECRET_BYTES,
    Reference,
    compaction_refs,
    compaction_target,
    read_reference,
    whole_prompt_tokens,
)
from gateway.context.history import Turn, clean_message, split_system
from gateway.exceptions import InvalidRequest
from gateway.upstream.demo import demo_reply


def test_a_reference_round_trips_and_opens_only_its_record() -> None:
    reference = Reference.of(bytes(range(ID_BYTES + SECRET_BYTES)))
    assert reference.compaction_id == "cmp_" + bytes(range(ID_BYTES)).hex()
    content = reference.encode()
    assert read_reference(content) == reference
    record = {"type": "compaction", "id": reference.compaction_id, "check": reference.check}
    assert reference.opens(record)
    other = Reference(reference.compaction_id, bytes(SECRET_BYTES))
    assert not other.opens(record)  # the same id, another secret
    assert not reference.opens({**record, "id": "cmp_00"}) and not reference.opens({**record, "check": 1})
    assert reference.secret.hex() not in str(record)  # the record keeps only a digest


@pytest.mark.parametrize(
    "content",
    ["", "not base64 at all!", "gAAAAABfake==", "é", base64.urlsafe_b64encode(bytes(29)).decode()],
)
def test_what_is_not_a_reference_reads_as_none(content: str) -> None:
    assert read_reference(content) is None


def test_compaction_items_are_found_and_checked() -> None:
    items = [{"role": "user", "content": "x"}, {"type": "compaction", "encrypted_content": "abc"}]
    assert compaction_refs(items, "input") == [("input[1].encrypted_content", "abc")]
    assert compaction_refs("a string input", "input") == []
    with pytest.raises(InvalidRequest) as caught:
        compaction_refs([{"type": "compaction", "encrypted_content": ["abc"]}], "input")
    assert caught.value.param == "input[0].encrypted_content"


def _turn(rid: str, text: str) -> Turn:
    return Turn(rid, ({"role": "user", "content": text},), {"role": "assistant", "content": "ok"})


def test_a_compaction_covers_every_turn_but_the_newest() -> None:
    view = rebuild_view([_turn("r1", "a"), _turn("r2", "b"), _turn("r3", "c")])
    assert compaction_target(view, 0) == "r2"
    assert compaction_target(view, 4) == "r3"  # r3 alone is left: it goes too
    assert compaction_target(view, 2) == "r2"
    assert compaction_target(rebuild_view([_turn("r1", "a")]), 0) == "r1"  # the only one
    assert compaction_target(view, 6) is None  # all covered
    view.count_tokens("cl100k_base", lambda m: 10)
    assert whole_prompt_tokens(view, 0, 0, 5) == 65
    assert whole_prompt_tokens(view, 4, 7, 5) == 20 + 7 + 5


def test_a_compaction_s_summary_is_history_and_never_sent_marked() -> None:
    summary = {"role": "system", "content": "Summary of ...", "compaction": {"id": "cmp_1"}}
    system, rest = split_system([{"role": "system", "content": "Be brief."}, summary])
    assert system == [{"role": "system", "content": "Be brief."}] and rest == [summary]
    assert clean_message(summary) == {"role": "system", "content": "Summary of ..."}


def test_the_demo_model_summarizes_with_the_facts_it_was_given() -> None:
    prompt = "Current summary:\nThe user said my name is Bob.\n\nNew messages:\nuser: my city is Oslo"
    messages = [
        {"role": "system", "content": "You maintain the running summary ..."},
        {"role": "user", "content": prompt},
    ]
    assert demo_reply(messages) == "The user said my name is Bob. The user said my city is Oslo."
    plain = "Current summary:\n(none yet)\n\nNew messages:\nuser: hello there\nassistant: hi"
    assert demo_reply([messages[0], {"role": "user", "content": plain}]) == 'The user said "hello there".'
