"""What each engine says and means: one home for every fact about a server's dialect.

Pure functions over parsed JSON and text, no I/O: the client, the contract suite and the gateway
do the requests and hand the answers here. Engines: vLLM, llama.cpp (``llama-server``), TGI,
SGLang, Ollama and our reference server (which speaks vLLM's dialect).

Sections:

- context-window discovery (which endpoint, which field);
- ``/tokenize`` request and answer shapes;
- KV budget discovery (for the gateway).
"""

from __future__ import annotations

__all__: list[str] = []

# --- context-window discovery ----------------------------------------------------------------

# --- /tokenize --------------------------------------------------------------------------------

# --- KV budget --------------------------------------------------------------------------------
