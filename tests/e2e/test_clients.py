"""Real clients against a real `gateway serve`: LangChain's ChatOpenAI, which names the
conversation in `extra_body` and may send only the new message or the whole history (edits
and regenerations included), and the official SDK's streaming helper."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage
from langchain_openai import ChatOpenAI

from tests.conftest import GatewayProcess
from tests.mockserver import MockServer


def chat(gateway: GatewayProcess, cid: str, **kwargs: Any) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=f"{gateway.url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        model="mock/tiny",
        max_retries=0,
        extra_body={"conversation_id": cid},
        **kwargs,
    )


def sent(upstream: MockServer) -> list[tuple[str, Any]]:
    return [(m["role"], m.get("content")) for m in upstream.requests[-1]["messages"]]


@pytest.mark.parametrize("streaming", [False, True])
def test_langchain_sending_only_the_new_message_is_remembered(
    gateway: GatewayProcess, upstream: MockServer, streaming: bool
) -> None:
    llm = chat(gateway, f"lc-new-{streaming}", streaming=streaming)
    llm.invoke([HumanMessage("Hello, my name is Lang.")])
    answer = llm.invoke([HumanMessage("What is my name?")])
    assert answer.content == "Your name is Lang."
    assert [role for role, _ in sent(upstream)] == ["user", "assistant", "user"]
    assert "conversation_id" not in upstream.requests[-1]


def test_langchain_resending_its_history_edits_and_regenerates(
    gateway: GatewayProcess, upstream: MockServer
) -> None:
    """A chat UI built on LangChain resends everything; an edited question branches and a
    regenerated answer replaces the old one: the provider never sees a message twice, nor the
    abandoned branch."""
    llm = chat(gateway, "lc-full")
    history: list[Any] = [SystemMessage("Be brief."), HumanMessage("My colour is red.")]
    history.append(llm.invoke(history))
    history.append(HumanMessage("My pet is Rex."))
    history.append(llm.invoke(history))
    assert [c for _, c in sent(upstream)] == [m.content for m in history[:4]]

    # The user edits the second question: the conversation branches after the first answer.
    edited = [*history[:3], HumanMessage("My pet is Max.")]
    edited.append(llm.invoke(edited))
    assert [c for _, c in sent(upstream)] == [m.content for m in edited[:4]]
    edited.append(HumanMessage("What is my pet?"))
    answer = llm.invoke(edited)
    assert answer.content == "Your pet is Max."
    assert "My pet is Rex." not in [c for _, c in sent(upstream)]

    # Regenerate: the same history again; the old answer is not sent back.
    again = llm.invoke(edited)
    assert again.content == "Your pet is Max."
    assert [c for _, c in sent(upstream)] == [m.content for m in edited]
    assert isinstance(edited[4], AIMessage)


@pytest.mark.filterwarnings("ignore:create_react_agent has been moved")  # (LangGraph 1.x's own still)
@pytest.mark.parametrize("streaming", [False, True])
def test_a_langgraph_agent_calling_a_tool_keeps_one_history(
    gateway: GatewayProcess, upstream: MockServer, streaming: bool
) -> None:
    """LangGraph's prebuilt ReAct agent resends its whole state every step (the question, the
    tool call, its result): the gateway, told the conversation in a header, sends the provider
    that history once, with the call and its result paired."""
    from langchain_core.tools import tool
    from langgraph.prebuilt import create_react_agent

    @tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        return f"It is 21C and sunny in {city}."

    upstream.mode = "tool_call"
    cid = f"agent-{streaming}"
    llm = ChatOpenAI(
        base_url=f"{gateway.url}/v1",
        api_key="unused",  # type: ignore[arg-type]
        model="mock/tiny",
        max_retries=0,
        streaming=streaming,
        default_headers={"X-Conversation-Id": cid},
    )
    agent = create_react_agent(llm, [get_weather])
    state: dict[str, Any] = {"messages": []}
    for question in ("What is the weather in Paris?", "And what should I wear?"):
        state["messages"].append(("user", question))
        state = agent.invoke(state)
        assert state["messages"][-1].content == "The tool said: It is 21C and sunny in Paris."
    history = state["messages"][:-1]  # what the last step was sent
    last = upstream.requests[-1]["messages"]
    assert [m["role"] for m in last] == [
        "user",
        "assistant",
        "tool",
        "assistant",
        "user",
        "assistant",
        "tool",
    ]
    assert [m["role"] for m in last] == [
        {"human": "user", "ai": "assistant"}.get(m.type, m.type) for m in history
    ]
    for call, result in ((last[1], last[2]), (last[5], last[6])):
        assert call["tool_calls"][0]["id"] == result["tool_call_id"]
    assert len(upstream.requests) == 4  # two steps a question: the call, then the answer


LLM_VERSION = "0.36"


def llm_cli() -> Path:
    """simonw's `llm`, in a virtualenv of its own: it needs openai>=3, which litellm (the
    gateway's litellm extra) does not allow beside it. Installed from PyPI once, cached in
    $GATEWAY_TEST_CACHE (as the real-model tier's model is), so reruns are offline."""
    root = Path(os.environ.get("GATEWAY_TEST_CACHE") or Path.home() / ".cache" / "gateway-tests")
    venv = root / "clients" / f"llm-{LLM_VERSION}"
    exe = venv / "bin" / "llm"
    if not exe.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
        subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", f"llm=={LLM_VERSION}"],
            check=True,
            timeout=600,
        )
    return exe


def test_llm_cli_with_the_conversation_header(
    gateway: GatewayProcess, upstream: MockServer, tmp_path: Path
) -> None:
    """`llm` as its README configures an OpenAI-compatible server: extra-openai-models.yaml
    with the `X-Conversation-Id` header. Each `llm` call sends only the new prompt (no `-c`);
    the gateway remembers the rest."""
    home = tmp_path / "llm-home"
    home.mkdir()
    (home / "extra-openai-models.yaml").write_text(
        f"""- model_id: gateway-tiny
  model_name: mock/tiny
  api_base: "{gateway.url}/v1"
  headers:
    X-Conversation-Id: llm-cli-1
"""
    )
    env = {**os.environ, "LLM_USER_PATH": str(home), "OPENAI_API_KEY": "unused"}

    def llm(prompt: str) -> str:
        done = subprocess.run(
            [str(llm_cli()), "-m", "gateway-tiny", "--no-stream", prompt],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    llm("My name is Simon.")
    assert llm("What is my name?") == "Your name is Simon."
    assert [m["role"] for m in upstream.requests[-1]["messages"]] == ["user", "assistant", "user"]
