"""Chat prompts: messages rendered with the model's chat template, safely.

Message content is text, never markup. The template's own text (role headers,
turn separators) is tokenized with its control tokens, while each message's
content is tokenized with special-token strings taken literally
(`split_special_tokens`): a user who writes `<|im_end|><|im_start|>system` gets
those characters, not a forged turn. For content without such strings the ids
equal the tokenizer's own `apply_chat_template(tokenize=True)` (tested on the
embedded model).
"""
from __future__ import annotations

import secrets
import threading
from typing import Sequence

ROLES = ("system", "user", "assistant")


def validate(messages: Sequence[dict]) -> None:
    if not messages:
        raise ValueError("messages is empty: send at least one message")
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}].role is {m.get('role')!r}; known roles: {', '.join(ROLES)}")
        if not isinstance(m.get("content"), str):
            raise ValueError(f"messages[{i}].content must be text")


def render(tokenizer, messages: Sequence[dict]) -> list:
    """Token ids of `messages` through the chat template, ending with the
    assistant's turn header (the generation prompt)."""
    validate(messages)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: send `text` with chat=false, or token ids")
    # Render with a unique placeholder per message, then tokenize around them.
    marks = [f"\x00{secrets.token_hex(8)}\x00" for _ in messages]
    rendered = tokenizer.apply_chat_template([{"role": m["role"], "content": k} for m, k in zip(messages, marks)],
                                             add_generation_prompt=True, tokenize=False)
    ids, pos = [], 0
    for mark, m in zip(marks, messages):
        at = rendered.find(mark, pos)
        if at < 0:
            raise ValueError("the chat template does not place message content verbatim; it cannot be "
                             "rendered safely: send token ids instead")
        ids += tokenizer.encode(rendered[pos:at], add_special_tokens=False)
        ids += tokenizer.encode(m["content"], add_special_tokens=False, split_special_tokens=True)
        pos = at + len(mark)
    ids += tokenizer.encode(rendered[pos:], add_special_tokens=False)
    return ids


# One tokenization at a time: a fast tokenizer's encode with split_special_tokens
# switches a flag on the shared Rust tokenizer for the call, so encodes running in
# parallel threads (the servers submit from a thread pool) turned other prompts'
# control tokens into text, about one prompt in eight under concurrency 8.
_ENCODE_LOCK = threading.Lock()


def encode_prompt(tokenizer, prompt, chat: bool = False) -> list:
    """Token ids for a text (through the chat template as one user message when
    `chat`), a list of chat messages ({"role", "content"} dicts), or an id list.
    Safe to call from several threads."""
    with _ENCODE_LOCK:
        return _encode(tokenizer, prompt, chat)


def _encode(tokenizer, prompt, chat: bool) -> list:
    if isinstance(prompt, str):
        if not prompt:
            return []
        if chat:
            return render(tokenizer, [{"role": "user", "content": prompt}])
        return tokenizer.encode(prompt, add_special_tokens=False)
    prompt = list(prompt)
    if prompt and isinstance(prompt[0], dict):
        return render(tokenizer, prompt)
    return prompt
