"""The clients of ``soak.py``: kvclient (streamed and not, remembering the faults injected
mid-stream), raw httpx streams that hang up at a random moment, and raw sockets that stop
reading; one seeded choice per request."""

from __future__ import annotations

import json
import random
import re
import socket
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import anyio
import httpx

from kvclient import APIResponseError, AsyncClient
from kvclient.loadgen import RecordTimer, WorkItem
from kvclient.loadgen._kvsender import KVClientSender

#: Long holders ask for this many tokens; stalled readers pipeline STALL_PIPELINE of them.
LONG_MAX_TOKENS = 2000
STALL_PIPELINE = 32


class _FaultAwareSender(KVClientSender):
    """kvclient's sender, remembering which requests an injected fault ended mid-stream."""

    def __init__(self, client: AsyncClient, *, stream: bool, faulted: set[int]) -> None:
        super().__init__(client, stream=stream)
        self._faulted = faulted

    async def _call(self, item: WorkItem, timer: RecordTimer) -> Any:
        try:
            return await super()._call(item, timer)
        except APIResponseError as exc:
            if "injected fault" in str(exc):
                self._faulted.add(timer.record.index)
            raise


@dataclass
class SoakSender:
    """One in ``hang_up_share`` requests is a raw httpx stream that hangs up at a random moment;
    the others go through kvclient, half of them streamed. Choices are seeded."""

    client: AsyncClient
    raw: httpx.AsyncClient
    hang_up_share: float
    seed: int
    stall_share: float = 0.0
    stall_seconds: float = 5.0
    short_share: float = 0.0
    long_share: float = 0.0
    address: tuple[str, int] = ("127.0.0.1", 0)
    faulted: set[int] = field(default_factory=set)
    kinds: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)
        # Their own threads: on anyio's default limiter (40) they would starve the client's.
        self._stall_threads = anyio.CapacityLimiter(256)
        self._stream = _FaultAwareSender(self.client, stream=True, faulted=self.faulted)
        self._plain = _FaultAwareSender(self.client, stream=False, faulted=self.faulted)

    async def send(self, item: WorkItem, timer: RecordTimer) -> None:
        roll = self._rng.random()
        hang_up_after = self._rng.uniform(0.0, 0.6)
        size = self._rng.random()
        if roll < self.hang_up_share:
            self.kinds["raw stream, hangs up"] += 1
            await self._hang_up(item, timer, hang_up_after)
            return
        raw = self.hang_up_share + self.stall_share
        if roll < raw:
            self.kinds["raw socket, stops reading"] += 1
            timer.mark_sent()
            timer.record.attempts = 1
            timer.record.error = await anyio.to_thread.run_sync(
                self._stall, item, limiter=self._stall_threads
            )
            timer.mark_end()
            return
        if size < self.short_share:
            item = replace(item, max_tokens=1)
            self.kinds["  of which max_tokens 1"] += 1
        elif size < self.short_share + self.long_share:
            item = replace(item, max_tokens=LONG_MAX_TOKENS)
            self.kinds[f"  of which max_tokens {LONG_MAX_TOKENS}"] += 1
        streamed = roll < raw + (1 - raw) / 2
        self.kinds["kvclient, streamed" if streamed else "kvclient"] += 1
        await (self._stream if streamed else self._plain).send(item, timer)
        record = timer.record
        if record.error == "http_500:injected_fault":
            record.error = "injected_fault"
        elif record.error == "bad_response" and record.index in self.faulted:
            record.error = "injected_fault (mid-stream)"

    def _stall(self, item: WorkItem) -> str:
        """A client that stops reading: streamed requests pipelined on one small-buffered
        socket, nothing read for ``stall_seconds``, then closed (in a worker thread)."""
        body = json.dumps({"prompt": item.prompt, "stream": True, "max_tokens": LONG_MAX_TOKENS})
        request = (
            "POST /v1/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body.encode())}\r\n\r\n{body}"
        ).encode()
        try:
            with socket.socket() as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                sock.settimeout(5)
                sock.connect(self.address)
                sock.sendall(request * STALL_PIPELINE)
                time.sleep(self.stall_seconds)
        except OSError as exc:
            return f"raw: {type(exc).__name__}"
        return "stopped reading (on purpose)"

    async def _hang_up(self, item: WorkItem, timer: RecordTimer, after: float) -> None:
        """A client that goes away: it reads the answer for ``after`` seconds, then hangs up."""
        record = timer.record
        body: dict[str, Any] = {"prompt": item.prompt, "stream": True}
        if item.max_tokens is not None:
            body["max_tokens"] = item.max_tokens
        timer.mark_sent()
        record.attempts = 1
        try:
            async with self.raw.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    payload = await response.aread()
                    record.http_429 += response.status_code == 429
                    code = re.search(rb'"code":\s*"([^"]+)"', payload)
                    record.error = f"http_{response.status_code}" + (
                        f":{code.group(1).decode()}" if code else ""
                    )
                    if record.error == "http_500:injected_fault":
                        record.error = "injected_fault"
                    elif response.status_code == 429:
                        record.error = "raw: 429 (not retried)"
                else:
                    received = bytearray()
                    with anyio.move_on_after(after) as scope:
                        async for chunk in response.aiter_raw():
                            received += chunk
                            if not record.token_times:
                                timer.mark_token()
                    if scope.cancelled_caught:
                        record.error = "hung up (on purpose)"
                    elif b'"code":"injected_fault"' in received:
                        record.error = "injected_fault (mid-stream)"
                    elif received.rstrip().endswith(b"data: [DONE]"):
                        record.ok = True
                    else:
                        record.error = "raw: stream cut"
        except httpx.HTTPError as exc:
            record.error = f"raw: {type(exc).__name__}"
        timer.mark_end()
