"""Prompts to token ids, the one place dspark applies a chat template.

The tokenizer is duck-typed (a Hugging Face tokenizer, or a test fake) with
`encode(text, add_special_tokens=False)` and
`apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`.
"""

from __future__ import annotations


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of a plain-text prompt (no special tokens added)."""
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of a conversation in the model's chat template, with the
    assistant's next turn opened."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # BatchEncoding in transformers 5
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def encode_prompt(tokenizer, text: str, *, chat: bool) -> list[int]:
    """A single user prompt, optionally wrapped in the chat template."""
    return encode_chat(tokenizer, [{"role": "user", "content": text}]) if chat else encode_text(tokenizer, text)
