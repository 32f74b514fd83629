"""Every error kvclient raises, under one base class.

    KVClientError
    ├── TokenizerError                 an encoding or tokenizer file cannot be loaded
    ├── ChatTemplateError              the model's chat template rejects the conversation
    ├── PromptTooLongError             the prompt alone fills the context (local or server's word)
    ├── APIConnectionError             no answer: connection refused or reset, DNS, ...
    │   └── APITimeoutError            no answer in time
    ├── APIResponseError               an answer we cannot read: bad JSON, truncated stream
    ├── APIStatusError                 the server answered 4xx/5xx (carries status, body, code)
    │   ├── BadRequestError            400
    │   ├── AuthenticationError        401
    │   ├── PermissionDeniedError      403
    │   ├── NotFoundError              404
    │   ├── UnprocessableEntityError   422
    │   ├── RateLimitError             429 (retryable: the server is full now)
    │   │   └── InsufficientQuotaError 429 insufficient_quota (not retryable)
    │   └── InternalServerError        5xx (500 is not retried)
    │       ├── BadGatewayError         502 (retryable)
    │       ├── ServiceUnavailableError 503 (retryable)
    │       └── GatewayTimeoutError     504 (retryable)
    └── ServerBusyError                gave up: attempts, deadline, wait cap or budget ran out

Each error carries the numbers a caller needs to act on it: token counts, context window, the
server's Retry-After, how many attempts were made (``attempts``) and the retries before it
(``history``, a tuple of ``RetryEvent``). ``retryable`` on connection and status errors says
whether kvclient would retry it.
"""

from __future__ import annotations

from typing import Any

import httpx

__all__ = [
    "APIConnectionError",
    "APIResponseError",
    "APIStatusError",
    "APITimeoutError",
    "AuthenticationError",
    "BadGatewayError",
    "BadRequestError",
    "ChatTemplateError",
    "GatewayTimeoutError",
    "InsufficientQuotaError",
    "InternalServerError",
    "KVClientError",
    "NotFoundError",
    "PermissionDeniedError",
    "PromptTooLongError",
    "RateLimitError",
    "ServerBusyError",
    "ServiceUnavailableError",
    "TokenizerError",
    "UnprocessableEntityError",
]


class KVClientError(Exception):
    """Base class of every error kvclient raises.

    ``attempts`` is how many requests the failed call sent (0 when it failed before sending),
    ``history`` the retries it made before giving up (``RetryEvent`` values).
    """

    attempts: int = 0
    history: tuple[Any, ...] = ()


class TokenizerError(KVClientError):
    """A token counter could not be loaded (missing encoding file, bad tokenizer.json)."""


class ChatTemplateError(KVClientError, ValueError):
    """The model's chat template rejects the conversation (e.g. roles that do not alternate).

    The server would answer 400 to the same request; nothing is sent. A ``ValueError`` too, as
    other bad input is.
    """


class PromptTooLongError(KVClientError):
    """The prompt alone fills the model's context window; nothing can be generated.

    Raised before sending when kvclient counts the prompt itself, and also when a server answers
    with its own context-length error (then the numbers are those the server reported, if any).
    ``prompt_tokens_lower_bound`` says that ``prompt_tokens`` is only a lower bound: vLLM stops
    counting a prompt once it is past the window ("at least N input tokens").
    """

    def __init__(
        self,
        message: str | None = None,
        *,
        prompt_tokens: int | None = None,
        context_window: int | None = None,
        prompt_tokens_lower_bound: bool = False,
        response: httpx.Response | None = None,
        body: Any = None,
        code: str | None = None,
    ) -> None:
        if message is None:
            at_least = "at least " if prompt_tokens_lower_bound else ""
            message = (
                f"prompt of {at_least}{prompt_tokens} tokens does not fit the context window of "
                f"{context_window} tokens (no room left for any output)"
            )
        super().__init__(message)
        self.message = message
        self.prompt_tokens = prompt_tokens
        self.prompt_tokens_lower_bound = prompt_tokens_lower_bound
        self.context_window = context_window
        self.response = response
        self.status_code = response.status_code if response is not None else None
        self.body = body
        self.code = code


class APIConnectionError(KVClientError):
    """The server could not be reached, or the connection broke before an answer arrived."""

    def __init__(
        self, message: str, *, request: httpx.Request | None = None, retryable: bool = True
    ) -> None:
        super().__init__(message)
        self.message = message
        self.request = request
        # Only failures before any answer arrived are retried: after that the server may have
        # done the work already (or a stream delivered output).
        self.retryable = retryable


class APITimeoutError(APIConnectionError):
    """No answer arrived within the timeout."""


class APIResponseError(KVClientError):
    """The server answered, but the answer cannot be read (malformed JSON, truncated stream)."""

    def __init__(self, message: str, *, response: httpx.Response | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.response = response


class APIStatusError(KVClientError):
    """The server answered with an error status.

    ``body`` is the decoded JSON body (or None), ``code`` and ``error_type`` come from OpenAI's
    ``{"error": {"message", "type", "code"}}`` shape when the server uses it.
    """

    def __init__(
        self,
        message: str,
        *,
        response: httpx.Response,
        body: Any = None,
        code: str | None = None,
        error_type: str | None = None,
        retry_after: float | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.response = response
        self.status_code = response.status_code
        self.body = body
        self.code = code
        self.error_type = error_type
        self.retry_after = retry_after
        self.retryable = retryable


class BadRequestError(APIStatusError):
    """400."""


class AuthenticationError(APIStatusError):
    """401."""


class PermissionDeniedError(APIStatusError):
    """403."""


class NotFoundError(APIStatusError):
    """404."""


class UnprocessableEntityError(APIStatusError):
    """422."""


class RateLimitError(APIStatusError):
    """429: the server has no capacity now. Retryable."""


class InsufficientQuotaError(RateLimitError):
    """429 with ``insufficient_quota``: waiting will not help. Never retried."""


class InternalServerError(APIStatusError):
    """5xx."""


class BadGatewayError(InternalServerError):
    """502: a proxy could not reach the server. Retryable."""


class ServiceUnavailableError(InternalServerError):
    """503: overloaded or starting up. Retryable."""


class GatewayTimeoutError(InternalServerError):
    """504: a proxy gave up waiting for the server. Retryable."""


class ServerBusyError(KVClientError):
    """kvclient gave up waiting for capacity.

    Raised when the attempts, the total deadline or the retry budget ran out, or when the server
    asked for a wait longer than the policy's cap or the time left: then kvclient fails at once
    instead of sleeping hopelessly. ``retry_after`` is the server's last advice in seconds (None
    if it gave none), ``attempts`` how many requests were sent, ``last_error`` the last failure.
    """

    def __init__(
        self,
        message: str,
        *,
        retry_after: float | None,
        attempts: int,
        last_error: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after
        self.attempts = attempts
        self.last_error = last_error
