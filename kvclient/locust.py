"""Locust integration: a ``User`` that sends through kvclient, for load beyond one machine.

Locust schedules users and scales out (``--processes``, ``--master``/``--worker``); kvclient makes
each request behave: explicit clamped ``max_tokens``, Retry-After honoured, one cooldown shared
by every user of a process. Every outcome reaches Locust's statistics through its request event:

- ``POST /v1/completions`` / ``POST /v1/chat/completions``: each call, its response time
  including any backoff, failed when kvclient gave up;
- ``REJECTED 429`` / ``REJECTED 503`` (type ``RETRY``): each rejection kvclient retried, with
  the wait it honoured as its time, so rejections are never hidden behind an eventual success
  (they are not failures: a failure is a call kvclient gave up on);
- ``STREAM TTFT`` (with ``stream = True``): time to first token of each streamed call.

A locustfile (``pip install 'kvclient[locust]'``)::

    from kvclient.locust import KVClientUser

    class Chat(KVClientUser):
        chat = True            # /v1/chat/completions; False for /v1/completions
        stream = True

    $ locust -f locustfile.py --host http://127.0.0.1:8000 --headless -u 32 -r 8 -t 1m
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any, ClassVar

from locust import User, events, task

from ._exceptions import KVClientError
from ._models import Completion, RetryEvent
from ._policy import RetryPolicy
from ._sync_client import Client
from ._tiktoken import TiktokenCounter
from .loadgen._kvsender import failure_cause
from .loadgen._workload import MIXED, Shape, SyntheticWorkload, WorkItem

__all__ = ["KVClientUser"]

_clients: dict[tuple[str, str | None, int | None, str | None], Client] = {}
_clients_lock = threading.Lock()


def _quiet_http_logs(environment: Any, **_kwargs: Any) -> None:
    """Locust logs at INFO, and httpx (kvclient's client sends with it) logs a line per HTTP
    request at INFO: thousands of lines over Locust's own. They show at ``--loglevel DEBUG``."""
    options = getattr(environment, "parsed_options", None)
    if str(getattr(options, "loglevel", "INFO")).upper() == "DEBUG":
        return
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


_init: Any = events.init  # locust's hooks are untyped
_init.add_listener(_quiet_http_logs)


class KVClientUser(User):
    """A Locust user whose requests go through one process-wide :class:`kvclient.Client`.

    Override :meth:`next_item` to send your own prompts; class attributes set the rest.
    """

    abstract = True

    model: ClassVar[str | None] = None
    context_window: ClassVar[int | None] = None
    api_key: ClassVar[str | None] = None
    chat: ClassVar[bool] = True
    stream: ClassVar[bool] = False
    shapes: ClassVar[tuple[Shape, ...]] = MIXED
    retry: ClassVar[RetryPolicy] = RetryPolicy(max_attempts=8, deadline=120.0)

    def __init__(self, environment: Any) -> None:
        super().__init__(environment)
        if not self.host:
            raise ValueError("KVClientUser needs a host: locust --host http://127.0.0.1:8000")
        self.client = self._shared_client()
        self._items = self._workload()

    def _shared_client(self) -> Client:
        # One client per process and server: its cooldown then spans every simulated user, as it
        # would span the threads of one real application.
        key = (str(self.host), self.model, self.context_window, self.api_key)
        with _clients_lock:
            client = _clients.get(key)
            if client is None:
                client = Client(
                    base_url=str(self.host),
                    model=self.model,
                    context_window=self.context_window,
                    api_key=self.api_key,
                    retry=self.retry,
                    on_retry=self._report_retry,
                )
                _clients[key] = client
            return client

    def _workload(self) -> Iterator[WorkItem]:
        workload = SyntheticWorkload(shapes=self.shapes, chat=self.chat, seed=id(self) % 2**32)
        counter = TiktokenCounter()
        while True:
            yield from workload.items(64, counter)

    def next_item(self) -> WorkItem:
        """The next request to send; override for your own workload."""
        return next(self._items)

    def _report_retry(self, event: RetryEvent) -> None:
        if event.status_code is None:
            name = "RETRIED connection error"
        else:
            name = f"REJECTED {event.status_code}"
        self.environment.events.request.fire(
            request_type="RETRY",
            name=name,
            response_time=event.wait * 1000,
            response_length=0,
            exception=None,
            context={"error": event.error},
        )

    def _fire(self, name: str, started: float, length: int, exc: BaseException | None) -> None:
        self.environment.events.request.fire(
            request_type="POST",
            name=name,
            response_time=(time.perf_counter() - started) * 1000,
            response_length=length,
            exception=exc,
            context={},
        )

    def _send(self, item: WorkItem) -> Completion:
        if not self.stream:
            if item.messages is not None:
                return self.client.chat(item.messages, max_tokens=item.max_tokens)
            return self.client.complete(item.prompt or "", max_tokens=item.max_tokens)
        started = time.perf_counter()
        if item.messages is not None:
            stream = self.client.chat_stream(item.messages, max_tokens=item.max_tokens)
        else:
            stream = self.client.complete_stream(item.prompt or "", max_tokens=item.max_tokens)
        first = True
        with stream:
            for chunk in stream:
                if first and chunk.text:
                    first = False
                    self.environment.events.request.fire(
                        request_type="STREAM",
                        name="STREAM TTFT",
                        response_time=(time.perf_counter() - started) * 1000,
                        response_length=0,
                        exception=None,
                        context={},
                    )
        return stream.completion

    @task
    def send_one(self) -> None:
        item = self.next_item()
        name = "/v1/chat/completions" if item.messages is not None else "/v1/completions"
        started = time.perf_counter()
        try:
            completion = self._send(item)
        except KVClientError as exc:
            self._fire(name, started, 0, RuntimeError(f"{failure_cause(exc)}: {exc}"))
            return
        self._fire(name, started, len(completion.text.encode()), None)
