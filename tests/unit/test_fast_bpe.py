"""tiktoken's encoder standing in for ``tokenizers`` where it gives the same ids.

- On the real tokenizers: exactly the tiktoken-derived ones (Llama 3, 3.1, Mistral Nemo) take the
  fast path, and for any text (added tokens mixed in) it gives ``tokenizers``' ids (hypothesis).
- On a small tiktoken-style tokenizer built here: it is taken; each structural difference that
  would make the two disagree (a merge out of order, a split that is not a merge, a normalizer,
  ``ignore_merges`` off, an added token with ``lstrip``, a second split regex) refuses it.
- The one costly check is remembered by the file's hash; a disagreement on load falls back.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvclient import HuggingFaceCounter
from kvclient._fast_bpe import _BYTES, FastBPE, agrees, fast_bpe
from tests.helpers.real_tokenizers import MODELS, counter, model_dir

tokenizers = pytest.importorskip("tokenizers")

FAST_MODELS = {"llama3", "llama3_1", "mistral_nemo"}
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# --- the real tokenizers -----------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_the_tiktoken_derived_tokenizers_take_the_fast_path(name: str) -> None:
    assert (counter(name)._bpe is not None) == (name in FAST_MODELS)


def _added(name: str) -> list[str]:
    spec = json.loads((model_dir(name) / "tokenizer.json").read_text(encoding="utf-8"))
    return [t["content"] for t in spec["added_tokens"]]


@pytest.fixture(scope="module", params=sorted(FAST_MODELS))
def real(request: pytest.FixtureRequest) -> tuple[FastBPE, Any, list[str]]:
    name = str(request.param)
    bpe = counter(name)._bpe
    assert bpe is not None
    reference = tokenizers.Tokenizer.from_file(str(model_dir(name) / "tokenizer.json"))
    return bpe, reference, _added(name)[:40]


_PIECES = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=" \t\n\r\u00a0\u3000'sSdDtT0123456789٣", max_size=20),
    st.sampled_from(["<|", "|>", "[INST]", "<s>", "'ll", " 's", "...", "🇫🇷", "e\u0301"]),
)


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_the_fast_path_gives_the_same_ids_for_any_text(
    real: tuple[FastBPE, Any, list[str]], data: st.DataObject
) -> None:
    bpe, reference, added = real
    parts = data.draw(st.lists(st.one_of(_PIECES, st.sampled_from(added)), max_size=8))
    text = "".join(parts)
    expected = reference.encode(text, add_special_tokens=False).ids
    assert bpe.encode(text) == expected
    assert bpe.count(text) == len(expected)


@pytest.mark.parametrize("name", sorted(FAST_MODELS))
def test_raw_counts_add_what_the_post_processor_adds(name: str) -> None:
    reference = tokenizers.Tokenizer.from_file(str(model_dir(name) / "tokenizer.json"))
    fast = counter(name)
    for text in ("", "a", "Hello there, general Kenobi.", "<|eot_id|>[INST] x"):
        assert fast.count(text) == len(reference.encode(text, add_special_tokens=True).ids) + (
            fast._extra_special
        )


# --- a small tiktoken-style tokenizer ----------------------------------------------------------

_TO_CHAR = {b: c for c, b in _BYTES.items()}
_WORDS = ["the", " the", "ing", " king", " sing", "ab", "aba", " 12", "hello", " world"]


def _tiktoken_style_spec() -> dict[str, Any]:
    """A byte-level BPE as tiktoken's converted ones are: 256 bytes, then tokens built by
    merging, and every split of a token into two tokens a merge, in the tokens' order."""
    vocab = {_TO_CHAR[b]: b for b in range(256)}

    def add(token: str) -> None:
        if token not in vocab:
            # A token needs a merge that makes it: its prefixes first.
            for k in range(2, len(token)):
                add(token[:k])
            vocab[token] = len(vocab)

    for word in _WORDS:
        add("".join(_TO_CHAR[b] for b in word.encode()))
    merges = [
        f"{token[:k]} {token[k:]}"
        for token in sorted(vocab, key=vocab.__getitem__)
        for k in range(1, len(token))
        if token[:k] in vocab and token[k:] in vocab
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": len(vocab) + i,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
            for i, text in enumerate(["<|bos|>", "<|eot|>", "<|eot|>x"])
        ],
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": LLAMA3_PATTERN},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": True,
                    "use_regex": False,
                },
            ],
        },
        "post_processor": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": False,
            "use_regex": True,
        },
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },
    }


def _load(spec: dict[str, Any]) -> Any:
    return tokenizers.Tokenizer.from_str(json.dumps(spec))


TEXTS = [
    "the king is singing; the kings sing",
    "aba abab ababa",
    "hello world 12 123 1234",
    "<|bos|>the<|eot|>x <|eot|>ing",
    "  spaces\n\nand lines\r\n",
    "naïve 日本 🚀",
]


def test_a_tiktoken_style_tokenizer_takes_the_fast_path_with_the_same_ids() -> None:
    spec = _tiktoken_style_spec()
    bpe = fast_bpe(spec)
    assert bpe is not None
    reference = _load(spec)
    for text in TEXTS:
        assert bpe.encode(text) == reference.encode(text, add_special_tokens=False).ids, text
    # "<|eot|>x" is longer than "<|eot|>": leftmost, then longest, as tokenizers matches.
    assert bpe.encode("<|eot|>x")[0] == spec["added_tokens"][2]["id"]
    assert agrees(bpe, reference, [t["content"] for t in spec["added_tokens"]])


def _merge_out_of_order(spec: dict[str, Any]) -> None:
    merges = spec["model"]["merges"]
    merges.append(merges.pop(0))


def _split_not_a_merge(spec: dict[str, Any]) -> None:
    model = spec["model"]
    first = next(m for m in model["merges"] if m.replace(" ", "") == _TO_CHAR[ord("a")] + "ba")
    model["merges"].remove(first)


def _set(path: str, value: Any) -> Any:
    def change(spec: dict[str, Any]) -> None:
        *parents, key = path.split(".")
        node: Any = spec
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        node[key] = value

    return change


REFUSED = {
    "a merge out of the vocabulary's order": _merge_out_of_order,
    "a split of a token that is not a merge": _split_not_a_merge,
    "a normalizer": _set("normalizer", {"type": "NFC"}),
    "ignore_merges off": _set("model.ignore_merges", False),
    "byte fallback": _set("model.byte_fallback", True),
    "dropout": _set("model.dropout", 0.1),
    "an added token that strips": _set("added_tokens.0.lstrip", True),
    "added tokens normalized differently": _set("added_tokens.1.normalized", True),
    "truncation": _set(
        "truncation",
        {"max_length": 8, "strategy": "LongestFirst", "stride": 0, "direction": "Right"},
    ),
    "a prefix space": _set("pre_tokenizer.pretokenizers.1.add_prefix_space", True),
    "a second split": _set(
        "pre_tokenizer.pretokenizers",
        [
            {
                "type": "Split",
                "pattern": {"Regex": r"\p{N}"},
                "behavior": "Isolated",
                "invert": False,
            },
            *_tiktoken_style_spec()["pre_tokenizer"]["pretokenizers"],
        ],
    ),
    "a post-processor of its own kind": _set(
        "post_processor", {"type": "BertProcessing", "sep": ["x", 1], "cls": ["y", 2]}
    ),
    "not the byte alphabet": _set("model.vocab", {"a": 0, "b": 1}),
}


@pytest.mark.parametrize("change", REFUSED.values(), ids=REFUSED.keys())
def test_what_tiktoken_would_tokenize_otherwise_is_refused(change: Any) -> None:
    spec = copy.deepcopy(_tiktoken_style_spec())
    change(spec)
    assert fast_bpe(spec) is None


def test_a_split_that_is_not_a_merge_really_tokenizes_otherwise() -> None:
    """Why the completeness check exists: without the merge "ab" + "a", tokenizers leaves "aba"
    in two pieces, where tiktoken (which merges any pair that forms a token) makes it one."""
    spec = _tiktoken_style_spec()
    _split_not_a_merge(spec)
    unchecked = fast_bpe(spec, merges_checked=True)
    assert unchecked is not None
    reference = _load(spec)
    assert any(
        unchecked.encode(t) != reference.encode(t, add_special_tokens=False).ids
        for t in ["aba", " aba", "xaba", "baba"]
    )


def _model_dir(tmp_path: Path, spec: dict[str, Any]) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec), encoding="utf-8")
    (tmp_path / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    return tmp_path


def test_the_merge_check_is_remembered_by_the_files_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCLIENT_CACHE", str(tmp_path / "cache"))
    directory = _model_dir(tmp_path, _tiktoken_style_spec())
    seen: list[bool] = []
    import kvclient._hf_tokenizer as hf_module

    def spy(spec: Any, *, merges_checked: bool = False) -> FastBPE | None:
        seen.append(merges_checked)
        return fast_bpe(spec, merges_checked=merges_checked)

    monkeypatch.setattr(hf_module, "fast_bpe", spy)
    first = HuggingFaceCounter.from_pretrained(directory)
    second = HuggingFaceCounter.from_pretrained(directory)
    assert seen == [False, True]
    assert first._bpe is not None
    assert second._bpe is not None
    assert first.count("the king sings") == second.count("the king sings")
    # Another file (one merge fewer) is another hash: checked again, and refused.
    broken = _tiktoken_style_spec()
    _split_not_a_merge(broken)
    other = HuggingFaceCounter.from_pretrained(_model_dir(tmp_path / "b", broken))
    assert seen[-1] is False
    assert other._bpe is None


def test_a_disagreement_on_load_falls_back_to_tokenizers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCLIENT_CACHE", str(tmp_path / "cache"))
    import kvclient._hf_tokenizer as hf_module

    monkeypatch.setattr(hf_module, "agrees", lambda *args: False)
    directory = _model_dir(tmp_path, _tiktoken_style_spec())
    fallback = HuggingFaceCounter.from_pretrained(directory)
    assert fallback._bpe is None
    reference = _load(_tiktoken_style_spec())
    assert fallback.count("the king") == len(reference.encode("the king").ids)
    assert HuggingFaceCounter.from_pretrained(directory, tiktoken_bpe=False)._bpe is None


def _leftmost_longest(words: list[str], text: str) -> list[str]:
    """What tokenizers does with added tokens, restated plainly: at the leftmost place where
    any word starts, the longest of them; then on from its end."""
    found, i = [], 0
    while i < len(text):
        here = [w for w in words if text.startswith(w, i)]
        if here:
            word = max(here, key=len)
            found.append(word)
            i += len(word)
        else:
            i += 1
    return found


@settings(max_examples=300, deadline=None)
@given(
    words=st.lists(st.text(alphabet="ab<|>", min_size=1, max_size=5), min_size=1, max_size=8),
    text=st.text(alphabet="ab<|>x", max_size=30),
)
def test_added_tokens_are_matched_leftmost_then_longest(words: list[str], text: str) -> None:
    import re

    from kvclient._fast_bpe import _trie_pattern

    pattern = re.compile(_trie_pattern(words))
    assert [m.group() for m in pattern.finditer(text)] == _leftmost_longest(words, text)
