"""Warm-up prefixes: what one is, how it is checked, and its token ids. Shared by the gateway's
POST /v1/cache/warmup and the `kvserve warmup FILE` job (which reads them from JSON lines).

A prefix is a map with exactly one of
    {"text": "..."}                                       raw text (few-shot examples, a document)
    {"system": "..."}                                     a system prompt, through the chat template
    {"messages": [{"role": ..., "content": ...}, ...]}    a chat prefix, through the template
and optionally "cache_salt" (a string). A message's role is a chat role and its content a
string: the messages go through the chat template as they are.
"""

from __future__ import annotations

from typing import Any

from kvserve.services.gateway.schema import CHAT_ROLES

KINDS = ("text", "system", "messages")


def check_prefix(obj: Any) -> str | None:
    """Why `obj` (one parsed prefix) is malformed, or None when it is fine."""
    kinds = [k for k in KINDS if isinstance(obj, dict) and k in obj]
    if len(kinds) != 1:
        return f"needs exactly one of {', '.join(KINDS)}"
    kind, value = kinds[0], obj[kinds[0]]
    if kind == "messages":
        if not isinstance(value, list) or not value or not all(map(_is_message, value)):
            return (
                "'messages' must be a non-empty list of messages, each with a role "
                f"({', '.join(CHAT_ROLES)}) and string content"
            )
    elif not isinstance(value, str) or not value:
        return f"{kind!r} must be a non-empty string"
    if not isinstance(obj.get("cache_salt"), str | None):
        return "'cache_salt' must be a string"
    return None


def _is_message(m: Any) -> bool:
    return isinstance(m, dict) and m.get("role") in CHAT_ROLES and isinstance(m.get("content"), str)


def prefix_ids(tokenizer: Any, prefix: dict[str, Any]) -> list[int]:
    """Token ids of one (checked) prefix, exactly as a later request starting with it
    tokenizes."""
    if "text" in prefix:
        return list(tokenizer.encode(prefix["text"]))
    messages = prefix.get("messages") or [{"role": "system", "content": prefix["system"]}]
    return list(tokenizer.encode(tokenizer.apply_chat_template(messages, False)))
