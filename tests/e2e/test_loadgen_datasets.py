"""Datasets (ShareGPT JSON, our JSONL) and synthetic prompts of exact lengths for any tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from kvclient import HuggingFaceCounter, TiktokenCounter
from kvclient.loadgen import cli
from kvclient.loadgen._workload import (
    Shape,
    SyntheticWorkload,
    exact_prompt,
    load_dataset,
    load_sharegpt,
)

COUNTER = TiktokenCounter()
CORPUS = [
    "the quick brown fox jumps over the lazy dog while the people of the world work",
    "data and information about health, family and life: a system for each group",
    "tokenizers split rare words into pieces; common ones stay whole",
] * 20


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory with a small byte-level BPE tokenizer.json trained here (offline)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["[UNK]"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    directory = tmp_path_factory.mktemp("model")
    tok.save(str(directory / "tokenizer.json"))
    return directory


def test_exact_prompt_for_a_tokenizer_that_splits_words(model_dir: Path) -> None:
    counter = HuggingFaceCounter(model_dir / "tokenizer.json")
    rng = random.Random(1)
    # The common words are several tokens each here, so the first draw is never exact.
    assert counter.count(" information") > 1
    for n in (1, 2, 7, 64, 513):
        assert counter.count(exact_prompt(n, counter, rng)) == n


def test_synthetic_workload_is_exact_for_the_given_tokenizer(model_dir: Path) -> None:
    counter = cli.make_counter(model_dir)  # a model directory, as --tokenizer takes it
    items = SyntheticWorkload(shapes=[Shape((20, 90), (5, 5))], seed=4).items(12, counter)
    assert all(i.prompt is not None and counter.count(i.prompt) == i.prompt_tokens for i in items)
    assert all(20 <= i.prompt_tokens <= 90 for i in items)
    assert cli.make_counter(model_dir / "tokenizer.json").count("hello") == counter.count("hello")


def test_exact_prompt_is_unchanged_for_cl100k() -> None:
    # The seeded workloads of earlier runs stay the same: cl100k is exact at the first draw.
    rng, again = random.Random(3), random.Random(3)
    from kvclient.loadgen import make_prompt

    assert exact_prompt(300, COUNTER, rng) == make_prompt(300, again)


SHAREGPT = [
    {
        "id": "a",
        "conversations": [
            {"from": "human", "value": "hello world"},
            {"from": "gpt", "value": "one two three four"},
            {"from": "human", "value": "and again"},
        ],
    },
    {"id": "b", "conversations": [{"from": "gpt", "value": "no human turn"}]},
    {"id": "c", "conversations": [{"from": "human", "value": "no reply yet"}]},
    {"id": "d", "conversations": "not a list"},
]


def test_sharegpt_first_human_turn_and_reply_length(tmp_path: Path) -> None:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    items = load_sharegpt(path, COUNTER)
    assert [(i.prompt, i.max_tokens) for i in items] == [
        ("hello world", 4),  # "one two three four": 4 tokens of reply
        ("no reply yet", None),
    ]
    chat = load_dataset(path, COUNTER, chat=True)  # told apart from JSONL by its '['
    assert chat[0].messages == [{"role": "user", "content": "hello world"}]


def test_jsonl_is_still_read_by_load_dataset(tmp_path: Path) -> None:
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt": "hello world", "max_tokens": 3}) + "\n")
    (item,) = load_dataset(path, COUNTER)
    assert (item.prompt_tokens, item.max_tokens) == (2, 3)


@pytest.mark.parametrize(
    ("text", "match"),
    [("[oops", "not JSON"), ('{"a": 1}', "a JSON list"), ("[]", "no conversation")],
)
def test_sharegpt_errors(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        load_sharegpt(path, COUNTER)
