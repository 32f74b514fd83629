"""Token counting: speed of every counter against its raw library, and the margins cl100k needs.

Goals:

- ``TiktokenCounter.count`` at least 0.9x the throughput of raw tiktoken ``encode_ordinary``;
- ``HuggingFaceCounter.from_pretrained(...).count`` (raw prompts) at least 0.9x the throughput of
  ``tokenizers``' own ``encode`` of the same text;
- ``from_pretrained(...).count_messages`` (render the chat template in full, then tokenize)
  against tokenizing the rendered text alone with ``tokenizers``' ``encode`` and
  ``encode_batch_fast`` (which the counter itself uses), and the render alone: measured, no goal.
  The count must be exact; every chat is rendered by Jinja, which costs tens to hundreds of µs a
  chat, most of a short chat's count;
- ``ServerTokenizeCounter``: the round trip to the reference server's ``/tokenize`` (measured,
  no goal: it is opt-in for that reason);
- the margin the default cl100k counter needs per model family to cover the real count, on the
  test corpus (``tests/helpers/tokenizer_corpus.py``): p99 and max, multiplicative and additive.

The real tokenizers come from ``scripts/fetch_tokenizers.py`` (fetched if missing).

    python bench/token_counting.py [--quick] [--models llama3_1,qwen3]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from _common import best_of, pin_to_cpu, print_table, reference_server_process, write_json

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvclient import (  # noqa: E402
    HuggingFaceCounter,
    ServerTokenizeCounter,
    TiktokenCounter,
)
from kvclient.loadgen import make_prompt  # noqa: E402
from tests.helpers import tokenizer_corpus as corpus  # noqa: E402

GOAL_RAW = 0.9
SIZES = (10, 1_000, 10_000)
HF_SIZES = (10, 100, 1_000, 10_000)
MODELS = ("llama3_1", "qwen3", "gemma3", "mistral_nemo", "deepseek_v3")


def _fetcher() -> Any:
    spec = importlib.util.spec_from_file_location(
        "fetch_tokenizers", ROOT / "scripts" / "fetch_tokenizers.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _interleaved(a: Any, b: Any, *, repeat: int, number: int) -> tuple[float, float]:
    """Best per-call times of ``a`` and ``b``, alternated so machine noise hits both alike."""
    a_s = b_s = float("inf")
    for _ in range(repeat):
        a_s = min(a_s, best_of(a, repeat=1, number=number))
        b_s = min(b_s, best_of(b, repeat=1, number=number))
    return a_s, b_s


def _interleaved_all(fns: list[Any], *, repeat: int, number: int) -> list[float]:
    """Best per-call times of each of ``fns``, alternated so machine noise hits all alike."""
    best = [float("inf")] * len(fns)
    for _ in range(repeat):
        for i, fn in enumerate(fns):
            best[i] = min(best[i], best_of(fn, repeat=1, number=number))
    return best


def tiktoken_speed(repeat: int, quick: bool) -> tuple[list[list[str]], list[dict[str, Any]], float]:
    load_code = (
        "import time; t=time.perf_counter(); from kvclient import TiktokenCounter; "
        "TiktokenCounter().load(); print(time.perf_counter()-t)"
    )
    load_seconds = min(
        float(subprocess.check_output([sys.executable, "-c", load_code], text=True))
        for _ in range(1 if quick else 3)
    )
    counter = TiktokenCounter().load()
    encoding = counter.encoding
    rng = random.Random(0)
    rows, results = [], []
    for size in SIZES:
        texts = [make_prompt(size, rng) for _ in range(50)]
        number = max(1, 20_000 // size)

        def raw(texts: list[str] = texts) -> None:
            for t in texts:
                len(encoding.encode_ordinary(t))

        def ours(texts: list[str] = texts) -> None:
            for t in texts:
                counter.count(t)

        raw_s, ours_s = _interleaved(raw, ours, repeat=repeat, number=number)
        tokens = size * len(texts)
        ratio = raw_s / ours_s
        results.append(
            {
                "prompt_tokens": size,
                "raw_tokens_per_s": tokens / raw_s,
                "kvclient_tokens_per_s": tokens / ours_s,
                "ratio": ratio,
            }
        )
        rows.append(
            [
                f"{size:,}",
                f"{tokens / raw_s / 1e6:.2f} M",
                f"{tokens / ours_s / 1e6:.2f} M",
                f"{ratio:.2f}x",
                "yes" if ratio >= GOAL_RAW else "NO",
            ]
        )
    return rows, results, load_seconds


def _chat(size: int, rng: random.Random) -> list[dict[str, Any]]:
    """A four-message chat of about ``size`` words."""
    return [
        {"role": "system", "content": make_prompt(max(1, size // 10), rng)},
        {"role": "user", "content": make_prompt(max(1, size // 2), rng)},
        {"role": "assistant", "content": make_prompt(max(1, size // 5), rng)},
        {"role": "user", "content": make_prompt(max(1, size // 5), rng)},
    ]


def hf_speed(
    name: str, directory: Path, repeat: int
) -> tuple[list[list[str]], list[list[str]], dict[str, Any]]:
    start = time.perf_counter()
    counter = HuggingFaceCounter.from_pretrained(directory)
    load_seconds = time.perf_counter() - start
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(directory / "tokenizer.json"))
    rng = random.Random(1)
    raw_rows, chat_rows = [], []
    results: dict[str, Any] = {"load_seconds": load_seconds, "raw": [], "chat": []}
    for size in HF_SIZES:
        texts = [make_prompt(size, rng) for _ in range(20)]
        number = max(1, 4_000 // size)

        def raw(texts: list[str] = texts) -> None:
            for t in texts:
                len(tok.encode(t))

        def ours(texts: list[str] = texts) -> None:
            for t in texts:
                counter.count(t)

        raw_s, ours_s = _interleaved(raw, ours, repeat=repeat, number=number)
        ratio = raw_s / ours_s
        results["raw"].append({"prompt_words": size, "ratio": ratio, "us_per_text": ours_s / 20e-6})
        raw_rows.append(
            [
                name,
                f"{size:,}",
                f"{raw_s / len(texts) * 1e6:,.0f}",
                f"{ours_s / len(texts) * 1e6:,.0f}",
                f"{ratio:.2f}x",
                "yes" if ratio >= GOAL_RAW else "NO",
            ]
        )

        chats = [_chat(size, rng) for _ in range(10)]
        rendered = [counter.render(c)[0] for c in chats]

        def encode_rendered(rendered: list[str] = rendered) -> None:
            for text in rendered:
                len(tok.encode(text, add_special_tokens=False))

        def fast_rendered(rendered: list[str] = rendered) -> None:
            for text in rendered:
                len(tok.encode_batch_fast([text], add_special_tokens=False)[0])

        def count_chats(chats: list[list[dict[str, Any]]] = chats, c: Any = counter) -> None:
            for chat in chats:
                c.count_messages(chat)

        def render(chats: list[list[dict[str, Any]]] = chats, c: Any = counter) -> None:
            for chat in chats:
                c.render(chat)

        times = _interleaved_all(
            [encode_rendered, fast_rendered, count_chats, render],
            repeat=repeat,
            number=number,
        )
        base_s, fast_s, chat_s, render_s = (t / len(chats) for t in times)
        factor, factor_fast = chat_s / base_s, chat_s / fast_s
        results["chat"].append(
            {
                "chat_words": size,
                "factor": factor,
                "factor_vs_encode_batch_fast": factor_fast,
                "encode_us": base_s * 1e6,
                "encode_batch_fast_us": fast_s * 1e6,
                "count_messages_us": chat_s * 1e6,
                "render_us": render_s * 1e6,
            }
        )
        chat_rows.append(
            [
                name,
                f"{size:,}",
                f"{base_s * 1e6:,.0f}",
                f"{fast_s * 1e6:,.0f}",
                f"{chat_s * 1e6:,.0f}",
                f"{factor:.2f}x",
                f"{factor_fast:.2f}x",
                f"{render_s * 1e6:,.0f}",
            ]
        )
    return raw_rows, chat_rows, results


def server_round_trip(directory: Path, repeat: int) -> tuple[list[list[str]], dict[str, Any]]:
    """The server in its own process on CPU 1 (in a thread of this one, the GIL would be
    measured instead), the counter on CPU 0."""
    local = HuggingFaceCounter.from_pretrained(directory)
    rng = random.Random(2)
    rows, results = [], {}
    pinned = pin_to_cpu(0)
    with (
        reference_server_process("--tokenizer", str(directory), cpu=1 if pinned else None) as url,
        ServerTokenizeCounter(url, engine="kvclient") as remote,
    ):
        for size in (10, 1_000):
            prompt = make_prompt(size, rng)
            chat = _chat(size, rng)
            assert remote.count(prompt) == local.count(prompt)
            assert remote.count_messages(chat) == local.count_messages(chat)
            number = 50 if size < 1000 else 20
            local_s, remote_s = _interleaved(
                lambda p=prompt: local.count(p),
                lambda p=prompt: remote.count(p),
                repeat=repeat,
                number=number,
            )
            chat_local_s, chat_remote_s = _interleaved(
                lambda c=chat: local.count_messages(c),
                lambda c=chat: remote.count_messages(c),
                repeat=repeat,
                number=number,
            )
            results[str(size)] = {
                "prompt_local_us": local_s * 1e6,
                "prompt_server_us": remote_s * 1e6,
                "chat_local_us": chat_local_s * 1e6,
                "chat_server_us": chat_remote_s * 1e6,
            }
            rows.append(
                [
                    f"{size:,}",
                    f"{local_s * 1e6:,.0f}",
                    f"{remote_s * 1e6:,.0f}",
                    f"{(remote_s - local_s) * 1e6:,.0f}",
                    f"{chat_local_s * 1e6:,.0f}",
                    f"{chat_remote_s * 1e6:,.0f}",
                ]
            )
    return rows, results


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def margins(name: str, directory: Path) -> tuple[list[str], dict[str, Any]]:
    """How far cl100k undercounts this model, on the corpus: the margins that would cover it."""
    exact = HuggingFaceCounter.from_pretrained(directory)
    default = TiktokenCounter()
    specials = exact.count("")  # what the server adds to every raw prompt (BOS)
    ratios, shortfalls, beyond_specials = [], [], []
    for text in corpus.texts():
        true, est = exact.count(text), default.count(text)
        ratios.append(true / est - 1 if est else 0.0)
        shortfalls.append(max(0, true - est))
        # The ratio still needed once safety_margin_tokens covers the specials.
        beyond_specials.append((true - specials) / est - 1 if est else 0.0)
    chat_ratios, chat_shortfalls = [], []
    for messages, _ in corpus.conversations(tools=False):
        try:
            true = exact.count_messages(messages)
        except ValueError:
            continue  # the template refuses it: the server would answer 400 whatever the count
        est = default.count_messages(messages)
        chat_ratios.append(true / est - 1)
        chat_shortfalls.append(max(0, true - est))
    data = {
        "texts": {
            "margin_p99": _quantile(ratios, 0.99),
            "margin_max": max(ratios),
            "tokens_p99": _quantile(shortfalls, 0.99),
            "tokens_max": max(shortfalls),
            "undercounted_share": sum(s > 0 for s in shortfalls) / len(shortfalls),
            "special_tokens": specials,
            "margin_p99_beyond_specials": _quantile(beyond_specials, 0.99),
            "margin_max_beyond_specials": max(beyond_specials),
        },
        "chats": {
            "margin_p99": _quantile(chat_ratios, 0.99),
            "margin_max": max(chat_ratios),
            "tokens_p99": _quantile(chat_shortfalls, 0.99),
            "tokens_max": max(chat_shortfalls),
            "undercounted_share": sum(s > 0 for s in chat_shortfalls) / len(chat_shortfalls),
        },
    }
    t, c = data["texts"], data["chats"]
    row = [
        name,
        f"{t['undercounted_share']:.0%}",
        f"{max(0.0, t['margin_p99']):.2f} / {max(0.0, t['margin_max']):.2f}",
        f"{specials} + {max(0.0, t['margin_p99_beyond_specials']):.2f} / "
        f"{max(0.0, t['margin_max_beyond_specials']):.2f}",
        f"{t['tokens_p99']:,} / {t['tokens_max']:,}",
        f"{c['undercounted_share']:.0%}",
        f"{max(0.0, c['margin_p99']):.2f} / {max(0.0, c['margin_max']):.2f}",
        f"{c['tokens_p99']:,} / {c['tokens_max']:,}",
    ]
    return row, data


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated families")
    args = parser.parse_args()
    repeat = 2 if args.quick else 7
    models = [m for m in args.models.split(",") if m]
    fetcher = _fetcher()
    directories = {name: Path(fetcher.fetch(name)) for name in models}

    rows, tiktoken_results, load_seconds = tiktoken_speed(repeat, args.quick)
    print_table(
        "TiktokenCounter.count vs raw tiktoken encode_ordinary (tokens/s), cl100k_base",
        ["prompt tokens", "raw tiktoken", "kvclient", "kvclient / raw", f">= {GOAL_RAW}x"],
        rows,
    )
    print(
        f"\nloading cl100k_base once per process (fresh interpreter): {load_seconds * 1e3:.0f} ms"
    )

    raw_rows, chat_rows, hf_results = [], [], {}
    for name, directory in directories.items():
        r, c, res = hf_speed(name, directory, repeat)
        raw_rows += r
        chat_rows += c
        hf_results[name] = res
    print_table(
        "from_pretrained count (raw prompt) vs tokenizers' own encode, µs per text",
        ["model", "words", "tokenizers", "kvclient", "throughput ratio", f">= {GOAL_RAW}x"],
        raw_rows,
    )
    print_table(
        "from_pretrained count_messages (render + tokenize) vs tokenizing the rendered "
        "text alone, µs per 4-message chat",
        [
            "model",
            "words",
            "encode",
            "encode_batch_fast",
            "count_messages",
            "vs encode",
            "vs batch_fast",
            "render alone",
        ],
        chat_rows,
    )

    first = next(iter(directories.values()))
    rt_rows, rt_results = server_round_trip(first, repeat)
    print_table(
        f"ServerTokenizeCounter round trip to the reference server ({next(iter(directories))} "
        "tokenizer, loopback), µs per count",
        ["words", "local prompt", "server prompt", "round trip", "local chat", "server chat"],
        rt_rows,
    )

    margin_rows, margin_results = [], {}
    for name, directory in directories.items():
        row, data = margins(name, directory)
        margin_rows.append(row)
        margin_results[name] = data
    print_table(
        "Margins the default cl100k counter needs per model family (corpus of 320 texts, 110 "
        "chats): safety_margin p99 / max, safety_margin_tokens p99 / max",
        [
            "model",
            "texts under",
            "texts margin",
            "texts tokens + margin",
            "texts tokens",
            "chats under",
            "chats margin",
            "chats tokens",
        ],
        margin_rows,
    )
    write_json(
        "token_counting",
        {
            "goals": {"raw": GOAL_RAW},
            "tiktoken": {"load_seconds": load_seconds, "results": tiktoken_results},
            "huggingface": hf_results,
            "server_round_trip": rt_results,
            "margins": margin_results,
            "at": time.time(),
        },
    )


if __name__ == "__main__":
    main()
