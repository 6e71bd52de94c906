"""Text in and out of the server: prompts to token ids, token ids to text deltas.

The tokenizer is duck-typed (a Hugging Face tokenizer, or a test fake) with:

    encode(text, add_special_tokens=False) -> list[int]
    decode(ids, skip_special_tokens=True) -> str
    apply_chat_template(messages, add_generation_prompt=True, tokenize=True) -> list[int]
"""

from __future__ import annotations



class TextStream:
    """Turns committed token batches into text deltas that never need taking back.

    The whole output is decoded after each batch (exact for tokenizers whose
    pieces merge, e.g. leading-space markers) and only the new suffix is
    released, except:
    - text ending in U+FFFD (an incomplete multi-byte character) is held back
      until the next tokens complete it;
    - the last len(longest stop string) - 1 characters are held back while a
      stop string could still be completing across batches.
    When a stop string appears, the text is cut right before it and the
    stream is `stopped`.
    """

    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # text released so far
        self.stopped = False  # a stop string was found; nothing more is released

    def push(self, new_token_ids: list[int], final: bool = False) -> str:
        """Add committed tokens; return the newly released text ('' if none).
        With `final`, release everything that is left (up to a stop string)."""
        if self.stopped:
            return ""
        self.token_ids.extend(new_token_ids)
        full = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = self._find_stop(full)
        if cut is not None:
            self.stopped = True
            return self._release(full[:cut])
        if final:
            return self._release(full)
        if full.endswith("\ufffd"):
            full = full.rstrip("\ufffd")
        ready = full[: max(len(full) - self._hold, len(self.text))]
        return self._release(ready)

    def _find_stop(self, full: str) -> int | None:
        if not self.stop:
            return None
        start = max(0, len(self.text) - self._hold)  # a stop cannot lie wholly in released text
        hits = [i for i in (full.find(s, start) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _release(self, upto: str) -> str:
        if len(upto) <= len(self.text) or not upto.startswith(self.text):
            # decoding changed already released text (rare tokenizer merges): keep what was sent
            return ""
        delta = upto[len(self.text):]
        self.text = upto
        return delta
