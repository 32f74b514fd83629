"""The simulated engine: real tokens, reproducible lengths, a physical pool that can overflow."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import anyio
import anyio.lowlevel
import pytest

from kvclient import TiktokenCounter
from reference_server import EngineOOMError, SimulatedEngine

pytestmark = pytest.mark.anyio

COUNTER = TiktokenCounter()


def make(**kw: object) -> SimulatedEngine:
    defaults: dict[str, object] = {
        "tokenizer": COUNTER,
        "capacity_tokens": 100_000,
        "decode_rate": 20_000.0,
        "mean_output_tokens": 50.0,
        "tick_seconds": 0.005,
    }
    defaults.update(kw)
    return SimulatedEngine(**defaults)  # type: ignore[arg-type]


async def test_generated_text_retokenizes_to_the_reported_count() -> None:
    engine = make(mean_output_tokens=300.0)
    for _ in range(5):
        completion = await engine.generate(10, 400)
        assert completion.completion_tokens >= 1
        assert COUNTER.count(completion.text) == completion.completion_tokens


async def test_streamed_pieces_make_the_whole_text() -> None:
    engine = make(decode_rate=5000.0, mean_output_tokens=10_000.0)
    pieces: list[str] = []

    async def on_text(text: str, generated: int) -> None:
        pieces.append(text)

    # 0.4 s of decoding: several ticks, however slow a busy machine makes one of them.
    completion = await engine.generate(5, 2000, on_text)
    assert len(pieces) > 1  # several ticks, not one burst
    assert "".join(pieces) == completion.text
    assert completion.completion_tokens == 2000
    assert completion.finish_reason == "length"


async def test_natural_length_stops_early_with_stop() -> None:
    engine = make(mean_output_tokens=5.0, seed=1)
    reasons = {(await engine.generate(1, 1000)).finish_reason for _ in range(10)}
    assert reasons == {"stop"}


async def test_cap_stops_with_length() -> None:
    engine = make(mean_output_tokens=10_000.0)
    completion = await engine.generate(1, 7)
    assert completion.finish_reason == "length"
    assert completion.completion_tokens == 7


async def test_ignore_eos_runs_to_the_cap_as_vllm_does() -> None:
    engine = make(mean_output_tokens=5.0, seed=1)
    completions = [await engine.generate(1, 60, ignore_eos=True) for _ in range(5)]
    assert {(c.completion_tokens, c.finish_reason) for c in completions} == {(60, "length")}


async def test_min_tokens_holds_the_end_back() -> None:
    engine = make(mean_output_tokens=5.0, seed=1)
    early = [await engine.generate(1, 100, min_tokens=40) for _ in range(5)]
    assert all(c.completion_tokens >= 40 for c in early)
    assert {c.finish_reason for c in early} == {"stop"}
    at_cap = await engine.generate(1, 40, min_tokens=40)
    assert (at_cap.completion_tokens, at_cap.finish_reason) == (40, "length")


async def test_holding_the_end_back_changes_no_other_output() -> None:
    plain, held = make(seed=3), make(seed=3)
    expected = [await plain.generate(1, 500) for _ in range(3)]
    await held.generate(1, 500, ignore_eos=True)
    assert [await held.generate(1, 500) for _ in range(2)] == expected[1:]


async def test_same_seed_same_outputs() -> None:
    first = [(await make(seed=42).generate(3, 500)).text for _ in range(1)]
    again = [(await make(seed=42).generate(3, 500)).text for _ in range(1)]
    other = [(await make(seed=43).generate(3, 500)).text for _ in range(1)]
    assert first == again
    assert first != other


async def test_decode_rate_paces_generation() -> None:
    engine = make(decode_rate=2000.0, mean_output_tokens=10_000.0, tick_seconds=0.01)
    start = anyio.current_time()
    await engine.generate(1, 200)
    assert anyio.current_time() - start >= 0.09  # 200 tokens at 2000/s = 0.1 s


async def test_pool_overflow_fails_every_sequence_and_empties_the_pool() -> None:
    # 8 sequences of 16-token prompts decoding up to 200 each: 1728 tokens > 1000 capacity.
    engine = make(capacity_tokens=1000, decode_rate=4000.0, mean_output_tokens=100_000.0)
    outcomes: list[str] = []

    async def one() -> None:
        try:
            await engine.generate(16, 200)
            outcomes.append("ok")
        except EngineOOMError as exc:
            outcomes.append(f"oom {exc.capacity_tokens}")

    async with anyio.create_task_group() as group:
        for _ in range(8):
            group.start_soon(one)
    assert outcomes == ["oom 1000"] * 8
    stats = engine.stats()
    assert stats.oom_events_total == 1
    assert stats.oom_failed_sequences_total == 8
    assert stats.used_tokens == 0
    assert stats.running == 0
    assert stats.peak_used_tokens > 1000


async def test_within_capacity_nothing_fails() -> None:
    engine = make(capacity_tokens=8 * 224, decode_rate=4000.0, mean_output_tokens=100_000.0)
    async with anyio.create_task_group() as group:
        for _ in range(8):
            group.start_soon(engine.generate, 16, 200)
    stats = engine.stats()
    assert stats.oom_events_total == 0
    assert stats.finished_total == 8
    assert stats.used_tokens == 0
    assert stats.peak_used_tokens <= 8 * 224


async def test_cancellation_frees_the_sequence() -> None:
    engine = make(decode_rate=1000.0, mean_output_tokens=100_000.0)
    with anyio.move_on_after(0.05):
        await engine.generate(100, 10_000)
    stats = engine.stats()
    assert stats.running == 0
    assert stats.used_tokens == 0
    assert stats.finished_total == 0


async def test_pool_counts_whole_blocks_of_prompt_plus_generated() -> None:
    engine = make(decode_rate=1000.0, mean_output_tokens=100_000.0, tick_seconds=0.005)
    seen: list[int] = []

    async def on_text(text: str, generated: int) -> None:
        seen.append(engine.stats().used_tokens)

    await engine.generate(17, 40, on_text)
    # The last piece is handed over after the step that ended the sequence freed its blocks.
    assert seen[-1] == 0
    assert seen[:-1]
    assert all(used % 16 == 0 and 32 <= used <= 64 for used in seen[:-1])


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="capacity_tokens"):
        make(capacity_tokens=0)
    with pytest.raises(ValueError, match="decode_rate"):
        make(decode_rate=0.0)
    with pytest.raises(ValueError, match="mean_output_tokens"):
        make(mean_output_tokens=0.0)
    with pytest.raises(ValueError, match="throughput"):
        make(throughput=0.0)
    with pytest.raises(ValueError, match="max_running"):
        make(max_running=0)


# --- lockstep steps, the cap on running sequences, shared prefixes -----------------------------


async def test_sequences_running_together_share_every_step() -> None:
    engine = make(decode_rate=1000.0)
    engine.vocabulary  # noqa: B018 - built before the three start, not while one waits
    async with anyio.create_task_group() as group:
        for _ in range(3):
            group.start_soon(lambda: engine.generate(10, 30, ignore_eos=True))
    stats = engine.stats()
    # Started together, so decoded by the same 30 steps: one token each per step.
    assert stats.steps_total == 30
    assert stats.generated_tokens_total == 90


async def test_beyond_max_running_a_sequence_waits_for_a_slot() -> None:
    # 40 tokens at 400/s: the first runs 0.1 s, long enough to be seen running on a busy machine.
    engine = make(decode_rate=400.0, max_running=1)
    seen: dict[str, list[tuple[int, int, int]]] = {"first": [], "second": []}

    async def one(name: str) -> None:
        async def on_text(text: str, generated: int) -> None:
            stats = engine.stats()
            seen[name].append((generated, stats.steps_total, stats.waiting))

        await engine.generate(10, 40, on_text, ignore_eos=True)

    async with anyio.create_task_group() as group:
        group.start_soon(one, "first")
        await anyio.lowlevel.checkpoint()
        group.start_soon(one, "second")
    # The second waited while the first ran.
    assert any(waiting == 1 for generated, _, waiting in seen["first"] if generated < 40)
    # The second's tokens came only after the first's 40 steps, one per step from then on.
    assert all(steps >= 40 + generated for generated, steps, _ in seen["second"])
    stats = engine.stats()
    assert (stats.running, stats.waiting, stats.used_tokens) == (0, 0, 0)
    assert stats.steps_total == 80


async def test_cancelling_a_waiting_sequence_frees_its_place() -> None:
    engine = make(decode_rate=1000.0, max_running=1, mean_output_tokens=100_000.0)
    async with anyio.create_task_group() as group:
        group.start_soon(lambda: engine.generate(10, 100))
        with anyio.move_on_after(0.02):
            await engine.generate(10, 100)
        assert engine.stats().waiting == 0
    assert engine.stats().finished_total == 1


async def test_a_prompt_shares_the_full_blocks_a_running_sequence_prefilled() -> None:
    prefix = list(range(1000, 1512))  # 32 blocks

    async def second_after_first_token(engine: SimulatedEngine) -> int:
        first_token = anyio.Event()

        async def on_text(text: str, generated: int) -> None:
            first_token.set()

        async with anyio.create_task_group() as group:
            group.start_soon(
                lambda: engine.generate(
                    520, 200, on_text, prompt_ids=[*prefix, *range(8)], ignore_eos=True
                )
            )
            await first_token.wait()
            await engine.generate(520, 20, prompt_ids=[*prefix, *range(10, 18)])
        return engine.stats().shared_blocks_total

    # A clock that moves only when read (half a step a read), not with the wall: a stalled
    # machine cannot let the first end before the second starts.
    def reads() -> Callable[[], float]:
        count = itertools.count()
        return lambda: next(count) * 0.00025

    assert (
        await second_after_first_token(make(decode_rate=2000.0, tick_seconds=0.001, clock=reads()))
        == 32
    )
    off = make(decode_rate=2000.0, tick_seconds=0.001, prefix_caching=False, clock=reads())
    assert await second_after_first_token(off) == 0
    assert off.stats().prefix_caching is False


async def test_the_same_seed_gives_the_same_outputs_whatever_the_cap_on_running() -> None:
    async def outputs(**kw: object) -> list[str]:
        engine = make(seed=5, **kw)
        texts: dict[int, str] = {}

        async def one(i: int) -> None:
            texts[i] = (await engine.generate(5, 60)).text

        async with anyio.create_task_group() as group:
            for i in range(4):
                group.start_soon(one, i)
                await anyio.lowlevel.checkpoint()
        return [texts[i] for i in range(4)]

    assert await outputs() == await outputs(max_running=2)
