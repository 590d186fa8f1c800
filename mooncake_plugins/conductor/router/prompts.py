"""What the router reads of an OpenAI request: validated, and the prompt's block hashes.

A policy needs the prompt's length in tokens and its chain of KV block ids
(``hash_ids``). With ``--tokenizer`` the router tokenizes as the engines do (a Hugging
Face tokenizer; chat messages through its chat template), so lengths are exact; a
completions request that sends token ids is exact without one. Otherwise text is cut
into blocks of ``4 x block_tokens`` UTF-8 bytes (about four bytes a token), which finds
the same shared prefixes but only estimates lengths. Block ids chain: block ``i``'s id
covers every token before it, so equal ids mean equal prefixes, as vLLM's block hashes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Sequence

BYTES_PER_TOKEN = 4
MAX_PROMPT_BLOCKS = 1 << 16


class BadRequest(ValueError):
    """A malformed client request (answered with HTTP 400 and this message)."""


@dataclass(frozen=True)
class RoutedRequest:
    """A request as policies see it (:class:`~..policies.PrefixRequest`)."""

    input_length: int
    hash_ids: Sequence[int]
    stream: bool
    max_tokens: int | None
    tokens: Sequence[int] | None = None   # the prompt's token ids, where known


def validate(path: str, body: Any) -> None:
    """Check the fields the router reads or changes; BadRequest says what is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the body must be a JSON object")
    if path.endswith("/chat/completions"):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise BadRequest("'messages' must be a non-empty list of objects with a 'role'")
    else:
        prompt = body.get("prompt")
        ok = isinstance(prompt, str) or (isinstance(prompt, list) and prompt and (
            all(isinstance(p, str) for p in prompt)
            or all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)))
        if not ok:
            raise BadRequest("'prompt' must be a string, a list of strings or a list of "
                             "token ids")
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("'stream' must be true or false")
    for key in ("max_tokens", "max_completion_tokens"):
        value = body.get(key)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                  or value < 1):
            raise BadRequest(f"'{key}' must be a positive integer")


def chain(blocks: Sequence[bytes]) -> list[int]:
    """Chained 64-bit ids of ``blocks``: each covers its block and every one before."""
    return chain_from(None, blocks)


def chain_from(parent: int | None, blocks: Sequence[bytes]) -> list[int]:
    """:func:`chain` continued after the block whose id is ``parent`` (None: the start)."""
    out, prev = [], b"" if parent is None else parent.to_bytes(8, "little")
    for block in blocks[:MAX_PROMPT_BLOCKS]:
        prev = hashlib.blake2b(prev + block, digest_size=8).digest()
        out.append(int.from_bytes(prev, "little"))
    return out


class Hasher:
    """Turns a validated body into a :class:`RoutedRequest`.

    Args:
        block_tokens: tokens per KV block (the engines' ``--block-size``).
        tokenize: text (or chat messages) to token ids, or None for the byte estimate.
    """

    def __init__(self, block_tokens: int,
                 tokenize: Callable[[str | list[dict]], list[int]] | None = None) -> None:
        self.block_tokens = block_tokens
        self.tokenize = tokenize

    def request(self, path: str, body: dict) -> RoutedRequest:
        validate(path, body)
        chat = path.endswith("/chat/completions")
        source: Any = body["messages"] if chat else body["prompt"]
        if isinstance(source, list) and source and isinstance(source[0], int):
            tokens: list[int] | None = source
        elif self.tokenize is not None:
            tokens = self.tokenize(source if chat or isinstance(source, str)
                                   else "".join(source))
        else:
            tokens = None
        if tokens is not None:
            n = self.block_tokens
            blocks = [json.dumps(tokens[i:i + n]).encode()
                      for i in range(0, len(tokens) - len(tokens) % n, n)]
            length = len(tokens)
        else:
            text = (json.dumps(source, sort_keys=True) if chat
                    else source if isinstance(source, str) else "".join(source)).encode()
            n = self.block_tokens * BYTES_PER_TOKEN
            blocks = [text[i:i + n] for i in range(0, len(text) - len(text) % n, n)]
            length = max(1, len(text) // BYTES_PER_TOKEN)
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        return RoutedRequest(length, chain(blocks), bool(body.get("stream")), limit, tokens)


def hf_tokenizer(name: str) -> Callable[[str | list[dict]], list[int]]:
    """A tokenizer function from a Hugging Face tokenizer name or path (transformers)."""
    from transformers import AutoTokenizer  # the engines' own dependency
    tok = AutoTokenizer.from_pretrained(name)

    def tokenize(source: str | list[dict]) -> list[int]:
        if isinstance(source, str):
            return list(tok(source)["input_ids"])
        return list(tok.apply_chat_template(source, tokenize=True, add_generation_prompt=True))

    return tokenize
