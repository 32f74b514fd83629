"""The server's own count: /tokenize dialects, ServerTokenizeCounter, and the reference server
counting with a real model's tokenizer end to end (``--tokenizer``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvclient import Client, ServerTokenizeCounter, TokenizerError
from kvclient.loadgen import cli as bench_cli
from reference_server import running_server
from reference_server.simulated.cli import build_parser, config_from_args
from tests.helpers import tokenizer_corpus as corpus
from tests.helpers.real_tokenizers import counter, model_dir

IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64," + "A" * 3000}}


# --- the counter over each dialect (count_by_tokenize, in kvclient/engines/tokenize.py) ---------


def _recording(seen: list[tuple[str, Any]], answer: Any) -> httpx.Client:
    def handler(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        seen.append((request.url.path, body))
        return answer(request.url.path, body)

    return httpx.Client(transport=httpx.MockTransport(handler))


def test_server_counter_speaks_vllm_with_tools_and_costs_media_locally() -> None:
    seen: list[tuple[str, Any]] = []
    http = _recording(seen, lambda path, body: httpx.Response(200, json={"count": 7}))
    tools = [{"type": "function", "function": {"name": "f"}}]
    tokens = ServerTokenizeCounter(
        "http://engine.test/v1", http_client=http, model="m", non_text_part_tokens=100
    )
    assert tokens.count("hi") == 7
    assert seen[-1] == ("/tokenize", {"prompt": "hi", "model": "m"})
    messages = [{"role": "user", "content": [{"type": "text", "text": "x"}, IMAGE]}]
    assert tokens.count_messages(messages, tools=tools) == 7 + 100
    assert seen[-1] == (
        "/tokenize",
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}]}],
            "add_generation_prompt": True,
            "tools": tools,
            "model": "m",
        },
    )
    assert ServerTokenizeCounter("http://x", engine="kvclient").engine == "vllm"
    with pytest.raises(ValueError, match="no /tokenize dialect"):
        ServerTokenizeCounter("http://x", engine="ollama")


def test_server_counter_speaks_llamacpp_in_two_calls() -> None:
    seen: list[tuple[str, Any]] = []

    def answer(path: str, body: Any) -> httpx.Response:
        if path == "/apply-template":
            return httpx.Response(200, json={"prompt": "rendered chat"})
        return httpx.Response(200, json={"tokens": list(range(len(body["content"].split())))})

    tokens = ServerTokenizeCounter(
        "http://engine.test", engine="llama.cpp", http_client=_recording(seen, answer)
    )
    assert tokens.count("one two three") == 3
    assert tokens.count_messages([{"role": "user", "content": "x"}]) == 2
    assert [path for path, _ in seen] == ["/tokenize", "/apply-template", "/tokenize"]
    assert seen[2][1] == {"content": "rendered chat", "add_special": True}


def test_server_counter_errors_are_tokenizer_errors_with_the_answer() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if b"boom" in request.content:
            raise httpx.ConnectError("refused")
        if b"bad" in request.content:
            return httpx.Response(200, text="not json")
        return httpx.Response(400, json={"error": {"message": "roles must alternate"}})

    http = httpx.Client(transport=httpx.MockTransport(handler))
    tokens = ServerTokenizeCounter("http://engine.test", http_client=http)
    with pytest.raises(TokenizerError, match=r"answered 400.*roles must alternate"):
        tokens.count("x")
    with pytest.raises(TokenizerError, match="ConnectError"):
        tokens.count("boom")
    with pytest.raises(TokenizerError, match="did not count it"):
        tokens.count("bad")
    tgi = ServerTokenizeCounter("http://engine.test", engine="tgi", http_client=http)
    with pytest.raises(TokenizerError, match="no request to make"):
        tgi.count_messages([{"role": "user", "content": "x"}])


# --- the reference server with a real tokenizer ---------------------------------------------------


def test_server_flag_loads_the_model_directory(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--tokenizer", str(model_dir("llama3_1"))])
    config = config_from_args(args)
    assert config.tokenizer.count("") == 1  # Llama 3.1's BOS
    with pytest.raises(ValueError, match="--tokenizer: no model directory"):
        config_from_args(build_parser().parse_args(["--tokenizer", str(tmp_path / "none")]))
    # A bare tokenizer.json, as every command's --tokenizer takes it: no BOS added to prompts.
    bare = build_parser().parse_args(["--tokenizer", str(model_dir("llama3_1") / "tokenizer.json")])
    assert config_from_args(bare).tokenizer.count("") == 0


def test_tokenize_endpoint_and_server_counter_agree_with_the_local_count() -> None:
    local = counter("mistral_nemo")
    with (
        running_server(tokenizer=local, context_window=4096, kv_tokens=16_384) as server,
        ServerTokenizeCounter(server.base_url, engine="kvclient") as remote,
    ):
        # Few calls: a loopback round trip to a server thread of this process is slow (the GIL).
        for text in corpus.texts(24, seed=3)[::2]:
            assert remote.count(text) == local.count(text)
        agreed = rejected = 0
        for messages, tools in corpus.conversations(24, seed=5):
            try:
                expected = local.count_messages(messages, tools=tools)
            except ValueError:
                # The template refuses it (roles, tool-call ids): so does the server, with a 400.
                with pytest.raises(TokenizerError, match="400"):
                    remote.count_messages(messages, tools=tools)
                rejected += 1
                continue
            assert remote.count_messages(messages, tools=tools) == expected
            agreed += 1
        assert agreed >= 16
        assert rejected >= 2
        # The ids are those of the rendered template.
        messages = [{"role": "user", "content": "hello"}]
        answer = httpx.post(server.base_url + "/tokenize", json={"messages": messages}).json()
        assert answer["tokens"] == local.encode_messages(messages)
        # A chat the template refuses is a 400 with the template's reason, not a 500.
        bad = httpx.post(
            server.base_url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
        )
        assert bad.status_code == 400
        assert "alternate" in bad.json()["error"]["message"]


@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_bench_against_a_server_counting_like_the_model(tmp_path: Path, chat: bool) -> None:
    """Server and client count with the same model directory: every count agrees, and with caps
    unset (max_tokens = context - prompt, exactly) no request exceeds the context."""
    directory = model_dir("llama3_1")
    window = 2048
    with running_server(
        tokenizer=counter("llama3_1"),
        context_window=window,
        kv_tokens=32_768,
        decode_rate=20_000,
        mean_output_tokens=20,
    ) as server:
        argv = [
            server.base_url,
            "--concurrency",
            "4",
            "--requests",
            "24",
            "--tokenizer",
            str(directory),
            "--prompt-tokens",
            "100:1900",
            "--max-tokens-range",
            "10:100",
            "--unset-cap-share",
            "0.5",
            "--no-progress",
            "--json",
            str(tmp_path / "run.json"),
            "--records",
        ]
        if chat:
            argv.append("--chat")
        assert bench_cli.main(argv) == 0
    records = json.loads((tmp_path / "run.json").read_text())["records"]
    assert len(records) == 24
    assert [r["error"] for r in records if not r["ok"]] == []
    assert all(r["server_prompt_tokens"] == r["prompt_tokens"] for r in records)
    assert all(r["prompt_tokens"] + r["max_tokens_sent"] <= window for r in records)
    # Caps left unset filled the context exactly: a count one short would have been refused.
    assert sum(r["prompt_tokens"] + r["max_tokens_sent"] == window for r in records) >= 6


def test_client_counts_with_the_server_counter() -> None:
    local = counter("llama3_1")
    with (
        running_server(tokenizer=local, context_window=1024, kv_tokens=8192) as server,
        ServerTokenizeCounter(server.base_url) as remote,
        Client(base_url=server.base_url, counter=remote) as client,
    ):
        result = client.complete("hello world")
        assert result.prompt_tokens == local.count("hello world") == 3
        assert result.usage is not None
        assert result.usage.prompt_tokens == 3
        assert result.max_tokens == 1024 - 3
