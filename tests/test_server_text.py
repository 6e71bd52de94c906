"""TextStream: incremental detokenization with held-back partial characters
and stop strings that may straddle token batches (no server needed)."""

from __future__ import annotations

import random

from dspark.server.textio import TextStream


class ByteTokenizer:
    """Token id = one UTF-8 byte; decoding an incomplete character gives U+FFFD,
    as Hugging Face byte-level tokenizers do."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def _ids(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _stream(text: str, batches: list[int], stop=()) -> tuple[list[str], TextStream]:
    ids, stream, deltas, pos = _ids(text), TextStream(ByteTokenizer(), tuple(stop)), [], 0
    for i, size in enumerate(batches):
        deltas.append(stream.push(ids[pos : pos + size], final=i == len(batches) - 1))
        pos += size
    return deltas, stream


def test_partial_multibyte_characters_are_held_back():
    deltas, stream = _stream("aé€b", [2, 1, 2, 2])  # a + half of é | rest of é | 2 of 3 bytes of € | ...
    assert deltas == ["a", "é", "", "€b"]
    assert stream.text == "aé€b" and not stream.stopped


def test_stop_string_straddling_batches_is_never_released():
    deltas, stream = _stream("hello world, bye", [3, 2, 2, 9], stop=("lo w",))
    # len("lo w") - 1 = 3 characters stay held back until the stop can no longer start in them
    assert deltas == ["", "he", "l", ""] and stream.stopped


def test_earliest_of_several_stop_strings_wins():
    deltas, stream = _stream("one two three", [13], stop=("three", "two"))
    assert stream.text == "one " and stream.stopped


def test_random_splits_match_the_cut_full_text():
    """300 random texts (ASCII and multi-byte), random batch splits, random stops:
    the released text always equals the full decode cut at the first stop."""
    rng = random.Random(0)
    alphabet = "ab c\né€😀"
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = tuple("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 3))) for _ in range(rng.randint(0, 2)))
        n = len(_ids(text))
        cuts = sorted(rng.sample(range(1, n), min(n - 1, rng.randint(0, 6)))) if n > 1 else []
        batches = [b - a for a, b in zip([0] + cuts, cuts + [n])] if n else [0]
        deltas, stream = _stream(text, batches, stops)
        hits = [text.find(s) for s in stops if s in text]
        want = text[: min(hits)] if hits else text
        assert "".join(deltas) == want, (text, stops, batches)
        assert stream.stopped == bool(hits)
