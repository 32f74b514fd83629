"""kvclient: call self-hosted LLM servers without out-of-memory crashes or retry storms.

Counts prompt tokens locally, always sends an explicit ``max_tokens`` clamped to the context
window, refuses locally a prompt that cannot fit, and honours 429 Retry-After with jittered
backoff. See the README for the whole admission contract.
"""

from ._accounting import (
    DEFAULT_BLOCK_SIZE,
    ModelProfile,
    effective_output_cap,
    kv_bytes_per_token,
    reservation_bytes,
    reservation_tokens,
    round_up_to_blocks,
    sequences_reservation_tokens,
    shared_prompt_tokens,
)
from ._async_client import AsyncClient, AsyncStream
from ._budget import RetryBudget
from ._exceptions import (
    APIConnectionError,
    APIResponseError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadGatewayError,
    BadRequestError,
    ChatTemplateError,
    GatewayTimeoutError,
    InsufficientQuotaError,
    InternalServerError,
    KVClientError,
    NotFoundError,
    PermissionDeniedError,
    PromptTooLongError,
    RateLimitError,
    ServerBusyError,
    ServiceUnavailableError,
    TokenizerError,
    UnprocessableEntityError,
)
from ._hf_tokenizer import HuggingFaceCounter
from ._models import Completion, CompletionChunk, RetryEvent, ToolCall, Usage
from ._policy import RetryPolicy
from ._server_counter import ServerTokenizeCounter
from ._sync_client import Client, Stream
from ._tiktoken import TiktokenCounter
from ._tokens import TokenCounter, Tokenizer, count_chat_request
from ._version import __version__
from .headers import parse_retry_after

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "APIConnectionError",
    "APIResponseError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "AsyncStream",
    "AuthenticationError",
    "BadGatewayError",
    "BadRequestError",
    "ChatTemplateError",
    "Client",
    "Completion",
    "CompletionChunk",
    "GatewayTimeoutError",
    "HuggingFaceCounter",
    "InsufficientQuotaError",
    "InternalServerError",
    "KVClientError",
    "ModelProfile",
    "NotFoundError",
    "PermissionDeniedError",
    "PromptTooLongError",
    "RateLimitError",
    "RetryBudget",
    "RetryEvent",
    "RetryPolicy",
    "ServerBusyError",
    "ServerTokenizeCounter",
    "ServiceUnavailableError",
    "Stream",
    "TiktokenCounter",
    "TokenCounter",
    "Tokenizer",
    "TokenizerError",
    "ToolCall",
    "UnprocessableEntityError",
    "Usage",
    "__version__",
    "count_chat_request",
    "effective_output_cap",
    "kv_bytes_per_token",
    "parse_retry_after",
    "reservation_bytes",
    "reservation_tokens",
    "round_up_to_blocks",
    "sequences_reservation_tokens",
    "shared_prompt_tokens",
]
