"""What each engine says and means: the one place a fact about vLLM, llama.cpp (``llama-server``),
TGI, SGLang, Ollama or our reference server (which speaks vLLM's dialect) lives.

The contract: pure functions and data over status codes, parsed JSON and text; no I/O. The
client, the contract suite, the load generator and the gateway make the requests and hand the
answers here; neither half keeps an engine fact of its own. Facts that are data (field names,
metric names, which engines do what) are tables; the functions only read them. Each module is
public and says what it holds; import names from the module that holds them:

- :mod:`~kvclient.engines.errors`: error answers and their meaning (which exception, whether a
  retry can help, the numbers a body carries, whether the KV cache ran out);
- :mod:`~kvclient.engines.discovery`: the model and its context window, and the probe/answer
  driver protocol (:class:`~kvclient.engines.discovery.Probe`,
  :class:`~kvclient.engines.discovery.Answer`) every discovery here speaks;
- :mod:`~kvclient.engines.tokenize`: an engine's own ``/tokenize`` count, and the chat fields
  that change what it renders;
- :mod:`~kvclient.engines.spend`: the fields that set a request's output length and its number
  of sequences, and their price;
- :mod:`~kvclient.engines.budget`: an engine's KV budget (``/metrics``, ``/props``,
  ``/get_server_info``);
- :mod:`~kvclient.engines.metrics`: metric names per engine as a table, and what they say:
  decode counters, lockstep signals, what an engine lost for lack of KV;
- :mod:`~kvclient.engines.behaviour`: what engines do, as measured: progress in streams, prompt
  sharing among a request's sequences, running to the cap, going on after a reset.

Engine names used throughout: ``"vllm"``, ``"llama.cpp"``, ``"tgi"``, ``"sglang"``,
``"ollama"``, and ``"kvclient"`` for our reference server.
"""
