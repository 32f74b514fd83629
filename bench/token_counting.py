"""Token counting: kvclient's counter against raw tiktoken on the same texts.

Goal: kvclient's ``TiktokenCounter.count`` at least 0.9x the throughput of raw
``tiktoken.Encoding.encode_ordinary`` (the wrapper must cost next to nothing), and the one-off
cost of loading the encoding.

    python bench/token_counting.py [--quick]
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import time

from _common import best_of, print_table, write_json

from kvclient import TiktokenCounter
from kvclient.loadgen import make_prompt

GOAL = 0.9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    repeat = 3 if args.quick else 7

    load_code = (
        "import time; t=time.perf_counter(); from kvclient import TiktokenCounter; "
        "TiktokenCounter().load(); print(time.perf_counter()-t)"
    )
    load_seconds = min(
        float(subprocess.check_output([sys.executable, "-c", load_code], text=True))
        for _ in range(1 if args.quick else 3)
    )

    counter = TiktokenCounter().load()
    encoding = counter.encoding
    rng = random.Random(0)
    rows, results = [], []
    for size in (10, 1_000, 10_000):
        texts = [make_prompt(size, rng) for _ in range(50)]
        number = max(1, 20_000 // size)

        def raw(texts: list[str] = texts) -> None:
            for t in texts:
                len(encoding.encode_ordinary(t))

        def ours(texts: list[str] = texts) -> None:
            for t in texts:
                counter.count(t)

        # Interleave the two so that machine noise hits both alike.
        raw_s = ours_s = float("inf")
        for _ in range(repeat):
            raw_s = min(raw_s, best_of(raw, repeat=1, number=number))
            ours_s = min(ours_s, best_of(ours, repeat=1, number=number))
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
                "yes" if ratio >= GOAL else "NO",
            ]
        )
    print_table(
        "Token counting throughput (tokens/s), kvclient vs raw tiktoken, cl100k_base",
        ["prompt tokens", "raw tiktoken", "kvclient", "kvclient / raw", f">= {GOAL}x"],
        rows,
    )
    print(
        f"\nloading cl100k_base once per process (fresh interpreter, incl. import): "
        f"{load_seconds * 1000:.0f} ms"
    )
    write_json(
        "token_counting",
        {"goal_ratio": GOAL, "load_seconds": load_seconds, "results": results, "at": time.time()},
    )


if __name__ == "__main__":
    main()
