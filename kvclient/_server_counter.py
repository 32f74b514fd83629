"""A counter backed by the server's own tokenizer: ``POST /tokenize`` (opt-in, one round trip).

Exact by construction, whatever the model: the server counts with the tokenizer and chat template
it will use. The price is a round trip before every request (measured in the README: about a
millisecond on loopback against the reference server), so it is opt-in; a local
``HuggingFaceCounter.from_pretrained`` is as exact where the model directory is at hand.

The request and answer shapes of each engine live in :mod:`kvclient.engines.tokenize`
(:func:`count_by_tokenize`, driven here with blocking I/O).
"""

from __future__ import annotations

from collections.abc import Generator, Mapping, Sequence
from typing import Any

import httpx

from ._exceptions import TokenizerError
from ._tokens import DEFAULT_NON_TEXT_PART_TOKENS, _check_part_tokens, _is_media_part
from .engines.discovery import Answer, Probe
from .engines.tokenize import TOKENIZE_ENGINES, count_by_tokenize

__all__ = ["ServerTokenizeCounter"]

DEFAULT_TOKENIZE_TIMEOUT = 10.0


def _without_media(messages: Sequence[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], int]:
    """Messages with their media parts taken out (costed locally), and how many there were.

    A text-only server would refuse them (vLLM tries to fetch the image); a multimodal one charges
    by its own rule, which ``non_text_part_tokens`` stands for.
    """
    checked: object = messages
    if isinstance(checked, (str, bytes)) or not isinstance(checked, Sequence):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} mappings")
    out: list[dict[str, Any]] = []
    media = 0
    for message in messages:
        if not isinstance(message, Mapping):
            raise TypeError(f"each message must be a mapping, got {type(message).__name__}")
        copy = dict(message)
        content = copy.get("content")
        if isinstance(content, list):
            kept = [part for part in content if not _is_media_part(part)]
            media += len(content) - len(kept)
            copy["content"] = kept
        out.append(copy)
    return out, media


#: Our reference server speaks vLLM's dialect.
_ENGINE_ALIASES = {"kvclient": "vllm", "llamacpp": "llama.cpp"}


class ServerTokenizeCounter:
    """Counts with the server's ``/tokenize`` endpoint, in its engine's dialect.

    >>> counter = ServerTokenizeCounter("http://127.0.0.1:8000", engine="vllm")  # doctest: +SKIP
    >>> Client(base_url=..., counter=counter)  # doctest: +SKIP

    ``engine``: ``"vllm"`` (our reference server too: ``"kvclient"``), ``"llama.cpp"``, or
    ``"tgi"`` (raw prompts only: its ``/tokenize`` has no chat form). ``base_url`` is the server's
    root (a trailing ``/v1`` is dropped: ``/tokenize`` is not under it). Pass ``http_client=`` to
    share connections; the counter closes only a client it made. A failed call raises
    :class:`~kvclient.TokenizerError` with the server's answer (the request is then not sent).
    Blocking I/O: in async code, prefer a local counter.
    """

    accepts_tools = True

    def __init__(
        self,
        base_url: str,
        *,
        engine: str = "vllm",
        model: str | None = None,
        api_key: str | None = None,
        http_client: httpx.Client | None = None,
        timeout: float = DEFAULT_TOKENIZE_TIMEOUT,
        non_text_part_tokens: int = DEFAULT_NON_TEXT_PART_TOKENS,
    ) -> None:
        engine = _ENGINE_ALIASES.get(engine, engine)
        if engine not in TOKENIZE_ENGINES:
            known = ", ".join(sorted(TOKENIZE_ENGINES | set(_ENGINE_ALIASES)))
            raise ValueError(f"no /tokenize dialect for engine {engine!r}: one of {known}")
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.engine = engine
        self.model = model
        self.non_text_part_tokens = _check_part_tokens(non_text_part_tokens)
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._owns_http = http_client is None
        self._http = http_client if http_client is not None else httpx.Client(timeout=timeout)
        self._timeout = timeout

    def __repr__(self) -> str:
        return f"ServerTokenizeCounter({self.base_url!r}, engine={self.engine!r})"

    def close(self) -> None:
        if self._owns_http:
            self._http.close()

    def __enter__(self) -> ServerTokenizeCounter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _answer(self, probe: Probe) -> tuple[Answer, str]:
        url = self.base_url + probe.path
        try:
            response = self._http.request(
                probe.method, url, json=probe.json, headers=self._headers, timeout=self._timeout
            )
        except httpx.HTTPError as exc:
            raise TokenizerError(f"{probe} at {url} failed: {type(exc).__name__}: {exc}") from exc
        try:
            payload = response.json()
        except ValueError:
            payload = None
        return Answer(response.status_code, payload), response.text[:300]

    def _drive(self, driver: Generator[Probe, Answer, int | None]) -> int:
        tried = []
        try:
            probe = next(driver)
            while True:
                answer, text = self._answer(probe)
                tried.append(f"{probe} answered {answer.status}: {text}")
                probe = driver.send(answer)
        except StopIteration as stop:
            count: int | None = stop.value
        if count is None:
            raise TokenizerError(
                f"{self.base_url} did not count it ({self.engine} /tokenize): "
                + ("; ".join(tried) or "no request to make")
            )
        return count

    def count(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"count() takes a str, got {type(text).__name__}")
        return self._drive(count_by_tokenize(self.engine, prompt=text, model=self.model))

    def count_messages(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> int:
        stripped, media = _without_media(messages)
        driver = count_by_tokenize(
            self.engine,
            messages=stripped,
            model=self.model,
            tools=[dict(t) for t in tools] if tools is not None else None,
        )
        return self._drive(driver) + media * self.non_text_part_tokens
