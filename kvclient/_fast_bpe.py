"""tiktoken's BPE for a ``tokenizer.json`` that it reproduces id for id.

Llama 3's tokenizer was tiktoken's before it was converted to a ``tokenizer.json``, and so were
others (Mistral Nemo's Tekken): a byte-level BPE whose merges follow the vocabulary's order, one
pre-tokenizing regex, ``ignore_merges``. For those, tiktoken's encoder built from the same
vocabulary gives the same ids as ``tokenizers``, several times faster on short texts (figures
in bench/token_counting.py), which is most of what a gateway spends counting a request.

:func:`fast_bpe` takes the parsed file and answers None unless every part of it is one whose
behaviour tiktoken shares:

- the model is BPE over GPT-2's byte-to-character alphabet, with all 256 bytes, no dropout, no
  byte fallback, no word prefix or suffix, and ``ignore_merges`` (a piece that is a token is that
  token, as tiktoken does);
- the merges are in the vocabulary's order, and every way of writing a token as two tokens is a
  merge: then "merge the pair ranked first" (``tokenizers``) and "merge the pair whose result has
  the lowest id" (tiktoken) take the same steps;
- no normalizer; one ``Split`` regex (isolated) followed by a ``ByteLevel`` that adds no prefix
  space and applies no regex of its own;
- added tokens without ``lstrip``/``rstrip``/``single_word``, all normalized alike: they are split
  out first, leftmost and longest, exactly as ``tokenizers`` does, and count one token each;
- no truncation or padding, a post-processor that adds the same tokens to every text.

Two regex engines still stand between the two (Oniguruma there, ``fancy-regex`` here), so
:func:`agrees` compares both on texts chosen where engines differ (Unicode spaces, digits of other
scripts, contractions, line breaks, emoji, every added token); HuggingFaceCounter uses the
fast path only when they agree.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["AGREEMENT_TEXTS", "FastBPE", "agrees", "fast_bpe"]


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet, character to byte: printable bytes stand for themselves, the
    others for 256 + their order."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars = dict.fromkeys(printable, 0)
    mapping = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


_BYTES = _byte_alphabet()
#: str.translate table: each alphabet character to the Latin-1 character of its byte.
_TO_LATIN1 = {ord(c): b for c, b in _BYTES.items()}
_POST_PROCESSORS = frozenset({"ByteLevel", "TemplateProcessing"})


class FastBPE:
    """Counts and encodes as the ``tokenizer.json`` it was built from, with tiktoken's encoder;
    :func:`fast_bpe` builds one."""

    __slots__ = ("_added", "_firsts", "_ordinary", "_split")

    def __init__(self, encoding: Any, added: Mapping[str, int]) -> None:
        self._ordinary = encoding.encode_ordinary
        self._added = dict(added)
        if added:
            self._split: re.Pattern[str] | None = re.compile("(" + _trie_pattern(added) + ")")
            self._firsts = "".join(sorted({token[0] for token in added}))
        else:
            self._split = None
            self._firsts = ""

    def _has_added(self, text: str) -> bool:
        # Cheaper than the regex: added tokens start with few characters ("<" for Llama 3).
        firsts = self._firsts
        if len(firsts) <= 4:
            return any(c in text for c in firsts)
        return True

    def count(self, text: str) -> int:
        """How many tokens ``text`` is, added tokens included, special tokens not added."""
        split = self._split
        if split is None or not self._has_added(text):
            return len(self._ordinary(text))
        pieces = split.split(text)
        ordinary = self._ordinary
        # split() with one group alternates: text, added token, text, ..., text.
        return sum(len(ordinary(piece)) for piece in pieces[::2] if piece) + len(pieces) // 2

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, special tokens not added."""
        split = self._split
        if split is None or not self._has_added(text):
            ids: list[int] = self._ordinary(text)
            return ids
        out: list[int] = []
        for i, piece in enumerate(split.split(text)):
            if i % 2:
                out.append(self._added[piece])
            elif piece:
                out.extend(self._ordinary(piece))
        return out


def _trie_pattern(words: Iterable[str]) -> str:
    """A regex matching any of ``words``, the longest where several start at one place (as
    ``tokenizers`` matches added tokens: leftmost, then longest), as a trie: Mistral Nemo has
    1,000 added tokens, too many for a plain alternation."""
    end = ""  # a node's key for "a word ends here" (no word is empty)
    trie: dict[str, Any] = {}
    for word in words:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[end] = {}

    def emit(node: dict[str, Any]) -> str:
        branches = [re.escape(char) + emit(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
        # Greedy: a longer word is tried before ending at this one.
        return f"(?:{body})?" if end in node else body

    return emit(trie)


def _is_empty_sequence(value: Any, key: str) -> bool:
    return value is None or (
        isinstance(value, Mapping) and value.get("type") == "Sequence" and not value.get(key)
    )


def _split_pattern(pre_tokenizer: Any) -> str | None:
    """The one regex of a ``Sequence[Split(regex, Isolated), ByteLevel(no prefix, no regex)]``."""
    if not isinstance(pre_tokenizer, Mapping) or pre_tokenizer.get("type") != "Sequence":
        return None
    steps = pre_tokenizer.get("pretokenizers")
    if not isinstance(steps, list) or len(steps) != 2:
        return None
    split, byte_level = steps
    if not (isinstance(split, Mapping) and isinstance(byte_level, Mapping)):
        return None
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert"):
        return None
    if byte_level.get("type") != "ByteLevel" or byte_level.get("add_prefix_space"):
        return None
    if byte_level.get("use_regex", True):
        return None
    pattern = split.get("pattern")
    regex = pattern.get("Regex") if isinstance(pattern, Mapping) else None
    return regex if isinstance(regex, str) else None


def _post_processor_is_constant(post: Any) -> bool:
    if post is None:
        return True
    if not isinstance(post, Mapping):
        return False
    if post.get("type") == "Sequence":
        steps = post.get("processors")
        return isinstance(steps, list) and all(_post_processor_is_constant(p) for p in steps)
    return post.get("type") in _POST_PROCESSORS


def _merges_follow_ranks(vocab: Mapping[str, int], merges: Sequence[Any]) -> bool:
    """Every merge joins two tokens into a token, in the vocabulary's order, and every way of
    writing a token as two tokens is a merge (so both rules see the same candidate pairs at every
    step and rank them alike)."""
    contains = vocab.__contains__
    last = -1
    seen = set()
    for merge in merges:
        if isinstance(merge, str):
            left, space, right = merge.partition(" ")
            if not space or " " in right:
                return False
        elif isinstance(merge, list) and len(merge) == 2:
            left, right = merge
        else:
            return False
        rank = vocab.get(left + right)
        if rank is None or rank < last or not (contains(left) and contains(right)):
            return False
        last = rank
        seen.add((left, right))
    splits = 0
    for token in vocab:
        for k in range(1, len(token)):
            if contains(token[k:]) and contains(token[:k]):
                splits += 1
    return splits == len(seen)


def fast_bpe(spec: Mapping[str, Any], *, merges_checked: bool = False) -> FastBPE | None:
    """A :class:`FastBPE` for the parsed ``tokenizer.json`` ``spec``, or None when tiktoken
    cannot be shown to tokenize as it does (see the module's docstring).

    ``merges_checked``: this very file's merges were shown to follow its ranks before (the one
    costly check, about a second for 128k tokens, is skipped)."""
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        return None
    if not _is_empty_sequence(spec.get("normalizer"), "normalizers"):
        return None
    if not _post_processor_is_constant(spec.get("post_processor")):
        return None
    pattern = _split_pattern(spec.get("pre_tokenizer"))
    model = spec.get("model")
    if pattern is None or not isinstance(model, Mapping) or model.get("type") != "BPE":
        return None
    if model.get("dropout") or model.get("byte_fallback") or not model.get("ignore_merges"):
        return None
    if model.get("continuing_subword_prefix") or model.get("end_of_word_suffix"):
        return None
    vocab = model.get("vocab")
    merges = model.get("merges") or []
    if not isinstance(vocab, Mapping) or not isinstance(merges, list):
        return None
    if not set("".join(vocab)) <= _BYTES.keys():
        return None  # not GPT-2's byte alphabet
    ranks = {token.translate(_TO_LATIN1).encode("latin-1"): rank for token, rank in vocab.items()}
    if len(ranks) != len(vocab) or any(bytes([b]) not in ranks for b in range(256)):
        return None
    added: dict[str, int] = {}
    normalized = set()
    for token in spec.get("added_tokens") or []:
        if token.get("lstrip") or token.get("rstrip") or token.get("single_word"):
            return None
        if not token.get("content"):
            return None
        normalized.add(bool(token.get("normalized")))
        added[token["content"]] = token["id"]
    if len(normalized) > 1:
        return None
    if not merges_checked and not _merges_follow_ranks(vocab, merges):
        return None
    try:
        import tiktoken

        encoding = tiktoken.Encoding(
            "kvclient-fast-bpe", pat_str=pattern, mergeable_ranks=ranks, special_tokens={}
        )
    except (ImportError, ValueError):  # a pattern fancy-regex does not take
        return None
    return FastBPE(encoding, added)


#: Texts on which the two regex engines and the two merge rules would show a difference.
AGREEMENT_TEXTS: tuple[str, ...] = (
    "Hello, world! It's a test: DON'T, I'M, we'll, they'VE, O'Neil's.",
    "   leading spaces, trailing spaces   ",
    "tabs\tand\nnew\r\nlines\r\n\r\n\n\n  \n\t end",
    "digits 1 12 123 1234 12345678901234567890 3.14159 1,000,000",
    "other digits ١٢٣٤٥ ۱۲۳ १२३४ ๑๒๓ 一二三 ①②③ ½ ²",
    "spaces\u00a0no-break\u2009thin\u3000ideographic\u2028line\u2029para\u200bzero-width",
    "combining e\u0301 a\u0308 n\u0303 and precomposed é ä ñ; Hangul 한국어 ᄒ\u1161\u11ab",
    "emoji 😀🚀👍🏽🇫🇷👨‍👩‍👧‍👦❤️ and ZWJ\u200dsequences",
    "中文文本，日本語のテキスト、ελληνικά, русский, عربي, עברית, ไทย",
    "code: def f(x):\n    return {'a': [1, 2, 3]} if x else None  # comment\n",
    'JSON {"key": "value", "n": -1.5e-10, "list": [true, false, null]}',
    "punctuation ... !!! ??? --- *** ((( ))) <<< >>> /// \\\\ |||| ~~~ ``` ''' \"\"\"",
    "MiXeD CaSe WoRdS ALLCAPS lowercase camelCase snake_case kebab-case",
    "urls https://example.com/path?q=1&r=2#frag and emails a.b@c.de",
    "\x00\x01\x7f control \x1b[0m chars \ufeff bom \ufffd replacement",
)


def agrees(bpe: FastBPE, tokenizer: Any, added: Sequence[str]) -> bool:
    """Whether ``bpe`` gives ``tokenizer``'s ids on :data:`AGREEMENT_TEXTS` and on each added
    token inside text (``tokenizer``: a ``tokenizers.Tokenizer``)."""
    texts = list(AGREEMENT_TEXTS)
    texts += [f"x{token}y {token} {token}{token}\n" for token in added]
    expected = tokenizer.encode_batch(texts, add_special_tokens=False)
    return all(bpe.encode(text) == e.ids for text, e in zip(texts, expected, strict=True))
