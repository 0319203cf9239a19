"""The request bodies' JSON schemas, as the OpenAPI document (openapi.py) describes them.

Every schema accepts exactly what the validation in `schema.py`, `prefixes.py` and the handlers
accepts (types, ranges, required fields, null where null means "absent"), so a schema fuzzer
(tests/services/test_schema_fuzz.py) finds no valid request that is refused and no invalid one
that is served. What depends on how the server runs (the served model's names, its context
window and vocabulary, API keys, whether clients may send a cache salt) comes in `ApiFacts`.
One thing no schema can say: the prompt plus `max_tokens` must fit in the context window (400
`context_length_exceeded`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvserve.services.gateway.auth import key_salt
from kvserve.services.gateway.schema import (
    CHAT_ROLES,
    MAX_COMPLETION_LOGPROBS,
    MAX_N,
    MAX_SEED,
    ModelInfo,
)
from kvserve.shared.sampling_params import MAX_TOP
from kvserve.shared.store.hashing import MAX_SALT_LEN

Schema = dict[str, Any]

SALT_CHARS = "A-Za-z0-9._:-"


@dataclass(frozen=True)
class ApiFacts:
    """What the document says that depends on how the server runs."""

    model_names: tuple[str, ...]  # the served name first, then the aliases it also accepts
    max_model_len: int
    vocab_size: int
    api_keys: bool = False  # the /v1 routes need `Authorization: Bearer KEY`
    # The longest `cache_salt` a client may send (the key's salt takes part of the limit);
    # None: a client's salt is refused (API keys without --allow-client-cache-salt).
    max_client_salt: int | None = MAX_SALT_LEN

    @classmethod
    def of(cls, model: ModelInfo, api_keys: bool, allow_client_salt: bool) -> ApiFacts:
        key_salt_len = len(key_salt("")) + 1  # a client's salt follows "{key salt}."
        if not api_keys:
            salt: int | None = MAX_SALT_LEN
        elif allow_client_salt:
            salt = MAX_SALT_LEN - key_salt_len
        else:
            salt = None
        names = (model.name, *sorted(model.aliases))
        return cls(names, model.max_model_len, model.vocab_size, api_keys, salt)


# ---- building blocks ---------------------------------------------------------------------------


def _nullable(schema: Schema) -> Schema:
    """`schema` or null: the server reads a null field as an absent one."""
    return {"anyOf": [schema, {"type": "null"}]}


_BOOL = _nullable({"type": "boolean"})


def model_schema(f: ApiFacts) -> Schema:
    return {"enum": [*f.model_names], "description": "the served model (404 for another)"}


def _token(f: ApiFacts) -> Schema:
    return {"type": "integer", "minimum": 0, "maximum": f.vocab_size - 1}


def _max_tokens(f: ApiFacts) -> Schema:
    return _nullable(
        {
            "type": "integer",
            "minimum": 1,
            "maximum": f.max_model_len - 1,
            "description": "the prompt plus max_tokens must fit in the context window",
        }
    )


def _cache_salt(f: ApiFacts) -> Schema:
    if f.max_client_salt is None:
        return {
            "type": "null",
            "description": "set by the server from the API key; a client's own is refused "
            "unless the server runs with --allow-client-cache-salt",
        }
    return _nullable(
        {
            "type": "string",
            "minLength": 1,
            "maxLength": f.max_client_salt,
            "pattern": f"^[{SALT_CHARS}]+$",
            "description": "narrows the prefix-cache partition (see docs/api.md)",
        }
    )


_STOP_STRING = {"type": "string", "minLength": 1}

TEXT_PART: Schema = {
    "type": "object",
    "required": ["type", "text"],
    "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
}

CHAT_MESSAGE: Schema = {
    "type": "object",
    "required": ["role"],
    "properties": {
        "role": {"enum": [*CHAT_ROLES]},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": TEXT_PART},
                {"type": "null"},
            ]
        },
    },
}

# A warm-up prefix's messages go through the chat template as they are: string content only.
PREFIX_MESSAGE: Schema = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {"role": {"enum": [*CHAT_ROLES]}, "content": {"type": "string"}},
}


def _requires_when_set(name: str, other: str, value: Any) -> Schema:
    """A `dependentSchemas` entry: a non-null `name` needs `other` == `value`."""
    return {
        name: {
            "anyOf": [
                {"properties": {name: {"type": "null"}}},
                {"required": [other], "properties": {other: {"const": value}}},
            ]
        }
    }


def _sampling(f: ApiFacts) -> Schema:
    return {
        "model": _nullable(model_schema(f)),
        "max_tokens": _max_tokens(f),
        "temperature": _nullable({"type": "number", "minimum": 0}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable(
            {"type": "integer", "minimum": -1, "description": "vLLM extension; 0 or -1: off"}
        ),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_N}),
        "seed": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_SEED}),
        "stop": _nullable(
            {"anyOf": [_STOP_STRING, {"type": "array", "items": _STOP_STRING}]},
        ),
        "stop_token_ids": _nullable({"type": "array", "items": _token(f)}),
        "ignore_eos": _BOOL,
        "min_tokens": _nullable(
            {
                "type": "integer",
                "minimum": 0,
                "description": "vLLM extension: no stop before this many tokens; <= max_tokens",
            }
        ),
        "skip_special_tokens": _BOOL,
        "stream": _BOOL,
        "stream_options": _nullable(
            {
                "type": "object",
                "description": "only with stream: true",
                "properties": {"include_usage": {"type": "boolean"}},
            }
        ),
        "cache_salt": _cache_salt(f),
        "user": _nullable(
            {"type": "string", "description": "the end user's id; the session router's key"}
        ),
        "return_tokens_as_token_ids": {
            **_BOOL,
            "description": "vLLM extension: logprobs name tokens 'token_id:{id}'",
        },
    }


# ---- request bodies ----------------------------------------------------------------------------


def completion_request(f: ApiFacts) -> Schema:
    token_ids = {"type": "array", "minItems": 1, "items": _token(f)}
    return {
        "type": "object",
        "required": ["prompt"],
        "properties": {
            "prompt": {
                "description": 'a string of no tokens ("" included) is run as the '
                "document-start token: the model generates as if from a new document",
                "oneOf": [
                    {"type": "string"},
                    {"type": "array", "minItems": 1, "items": {"type": "string"}},
                    token_ids,
                    {"type": "array", "minItems": 1, "items": token_ids},
                ],
            },
            "logprobs": _nullable(
                {"type": "integer", "minimum": 0, "maximum": MAX_COMPLETION_LOGPROBS}
            ),
            **_sampling(f),
        },
        "dependentSchemas": _requires_when_set("stream_options", "stream", True),
    }


def chat_request(f: ApiFacts) -> Schema:
    return {
        "type": "object",
        "required": ["messages"],
        "properties": {
            "messages": {"type": "array", "minItems": 1, "items": CHAT_MESSAGE},
            "max_completion_tokens": _max_tokens(f),
            "logprobs": _BOOL,
            "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_TOP}),
            "add_generation_prompt": _BOOL,
            "response_format": _nullable(
                {
                    "type": "object",
                    "required": ["type"],
                    "properties": {"type": {"const": "text"}},
                }
            ),
            **_sampling(f),
        },
        "dependentSchemas": {
            **_requires_when_set("stream_options", "stream", True),
            **_requires_when_set("top_logprobs", "logprobs", True),
        },
    }


def tokenize_request(f: ApiFacts) -> Schema:
    return {
        "type": "object",
        "description": "exactly one of prompt, messages",
        "properties": {
            "model": _nullable(model_schema(f)),
            "prompt": {"type": "string"},
            "messages": {"type": "array", "minItems": 1, "items": CHAT_MESSAGE},
            "add_generation_prompt": _BOOL,
            "return_token_strs": _BOOL,
        },
        "oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}],
    }


def detokenize_request(f: ApiFacts) -> Schema:
    return {
        "type": "object",
        "required": ["tokens"],
        "properties": {
            "model": _nullable(model_schema(f)),
            "tokens": {"type": "array", "items": _token(f)},
        },
    }


def warmup_request(f: ApiFacts) -> Schema:
    prefix = {
        "type": "object",
        "description": "exactly one of system, text, messages; optional cache_salt",
        "properties": {
            "system": {"type": "string", "minLength": 1},
            "text": {"type": "string", "minLength": 1},
            "messages": {"type": "array", "minItems": 1, "items": PREFIX_MESSAGE},
            "cache_salt": _cache_salt(f),
        },
        "oneOf": [{"required": [k]} for k in ("system", "text", "messages")],
    }
    return {
        "type": "object",
        "required": ["prefixes"],
        "properties": {"prefixes": {"type": "array", "minItems": 1, "items": prefix}},
    }
