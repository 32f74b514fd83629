"""The client reads its base URL and API key from the environment when they are not passed."""

from __future__ import annotations

import httpx
import pytest

from kvclient import AsyncClient, Client

NAMES = ("KVCLIENT_BASE_URL", "OPENAI_BASE_URL", "KVCLIENT_API_KEY", "OPENAI_API_KEY")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)


def _seen_headers() -> dict[str, str]:
    """The headers and URL of a request a client built from the environment sends."""
    seen: dict[str, str] = {}

    def handler(request: httpx.Request) -> httpx.Response:
        seen.update(request.headers)
        seen["url"] = str(request.url)
        return httpx.Response(
            200, json={"object": "list", "data": [{"id": "m", "max_model_len": 64}]}
        )

    with Client(model="m", transport=httpx.MockTransport(handler)) as client:
        client.discover()  # the context window from GET /v1/models: a real request
    return seen


def test_openai_names_are_read(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:8000/v1")  # as the openai SDK has it
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    client = Client(model="m", context_window=64)
    assert client.base_url == "http://127.0.0.1:8000"
    assert client.api_key == "sk-env"
    headers = _seen_headers()
    assert headers["authorization"] == "Bearer sk-env"
    assert headers["url"] == "http://127.0.0.1:8000/v1/models"


def test_kvclient_names_win_and_arguments_win_over_both(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:1")
    monkeypatch.setenv("KVCLIENT_BASE_URL", "http://127.0.0.1:2")
    monkeypatch.setenv("OPENAI_API_KEY", "openai")
    monkeypatch.setenv("KVCLIENT_API_KEY", "ours")
    client = AsyncClient()
    assert (client.base_url, client.api_key) == ("http://127.0.0.1:2", "ours")
    client = AsyncClient(base_url="http://127.0.0.1:3", api_key="given")
    assert (client.base_url, client.api_key) == ("http://127.0.0.1:3", "given")


def test_empty_values_count_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVCLIENT_API_KEY", "")
    monkeypatch.setenv("OPENAI_API_KEY", "fallback")
    assert Client(base_url="http://127.0.0.1:1").api_key == "fallback"


def test_no_url_anywhere_says_where_to_put_one() -> None:
    with pytest.raises(ValueError, match="KVCLIENT_BASE_URL or OPENAI_BASE_URL"):
        Client()
