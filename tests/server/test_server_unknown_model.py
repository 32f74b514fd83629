"""The reference server answers an unknown model with vLLM's 404, naming what it serves."""

from __future__ import annotations

import httpx
import pytest

from kvclient import AsyncClient
from kvclient._exceptions import APIStatusError
from reference_server import ServerConfig, create_app

CONFIG = ServerConfig(kv_tokens=4096, context_window=1024, decode_rate=20_000.0)


@pytest.mark.anyio
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_unknown_model_is_404_with_the_served_names(path: str) -> None:
    app = create_app(CONFIG)
    body: dict[str, object] = {"model": "gtp-4", "max_tokens": 4}
    body.update(
        {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    )
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
        response = await http.post(path, json=body)
        served = await http.post(path, json={**body, "model": CONFIG.model})
        unnamed = await http.post(path, json={k: v for k, v in body.items() if k != "model"})
    assert response.status_code == 404
    error = response.json()["error"]
    assert error["message"] == f"The model `gtp-4` does not exist. Served: {CONFIG.model}."
    assert (error["type"], error["code"], error["param"]) == (
        "NotFoundError",
        "model_not_found",
        "model",
    )
    assert served.status_code == unnamed.status_code == 200
    assert app.state.server.ledger.stats().admitted_total == 2  # the 404 reserved nothing


@pytest.mark.anyio
async def test_the_client_does_not_retry_it() -> None:
    app = create_app(CONFIG)
    transport = httpx.ASGITransport(app=app)
    async with AsyncClient(
        base_url="http://t", model="gtp-4", context_window=1024, transport=transport
    ) as client:
        with pytest.raises(APIStatusError, match="does not exist") as caught:
            await client.complete("hi", max_tokens=4)
    assert caught.value.status_code == 404
    assert caught.value.attempts == 1
