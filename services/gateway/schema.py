"""OpenAI request bodies -> a validated `GenerationPlan` (token ids + SamplingParams).

Everything a request can get wrong is found here, before the bus: types, ranges, the model
name, the chat template, the context window. Errors name the offending field (`param`).
Parameters the engine cannot honour are refused (400, code `unsupported_parameter`) rather than
silently ignored; unknown extra fields are ignored, as vLLM does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.services.gateway.errors import APIError, bad_request, unsupported
from kvserve.shared.model.tokenizer import ChatTemplateError, KVTokenizer
from kvserve.shared.sampling_params import FAULTS, MAX_TOP, InvalidRequestError, SamplingParams

MAX_N = 16
MAX_SEED = 2**63 - 1
MAX_COMPLETION_LOGPROBS = 5  # completions' `logprobs`: alternatives per token
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class ModelInfo:
    """What the gateway knows of the served model, read without torch."""

    name: str
    tokenizer: KVTokenizer
    max_model_len: int
    vocab_size: int
    path: str = ""
    aliases: tuple[str, ...] = ()

    def accepts(self, name: str) -> bool:
        return name == self.name or name in self.aliases


def load_model_info(model_path: str | Path, served_name: str | None = None) -> ModelInfo:
    """Tokenizer and context window from a GGUF file or an HF directory (no weights)."""
    from kvserve.shared.config import ModelConfig
    from kvserve.shared.model.gguf_file import gguf_model_config, open_gguf

    p = Path(model_path)
    if not p.exists():
        raise FileNotFoundError(f"model not found at {p}; run `kvserve fetch-model`")
    tok = KVTokenizer.from_path(p)
    if p.is_file():
        cfg = gguf_model_config(open_gguf(str(p.resolve())))
        default_name = p.stem.split(".")[0]
    else:
        cfg = ModelConfig.from_json_file(p / "config.json")
        default_name = p.name
    name = served_name or default_name
    aliases = tuple({default_name, p.name} - {name})
    return ModelInfo(name, tok, cfg.max_position_embeddings, cfg.vocab_size, str(p), aliases)


@dataclass(frozen=True)
class GenerationPlan:
    kind: str  # "completion" | "chat"
    model: str
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    logprobs: bool = False
    cache_salt: str | None = None  # what the client asked for (combined with the key's later)
    # vLLM's extension: logprobs name each token "token_id:{id}" instead of its text.
    tokens_as_ids: bool = False
    # OpenAI's end-user id: the "session" router's key, never a sampling parameter.
    user: str | None = None


# ---- field readers ---------------------------------------------------------------------------


def _get(body: dict[str, Any], name: str) -> Any:
    return body.get(name)


def _as_int(v: Any) -> int | None:
    """`v` as an int when it is a whole number, else None (booleans included). JSON does not
    tell 2 from 2.0 (JSON Schema's `integer` is any number without a fraction), nor does this."""
    if isinstance(v, bool):
        return None
    if isinstance(v, int):
        return v
    return int(v) if isinstance(v, float) and v.is_integer() else None


def _int(
    body: dict[str, Any], name: str, default: int | None, lo: int | None, hi: int | None = None
) -> int | None:
    raw = _get(body, name)
    if raw is None:
        return default
    v = _as_int(raw)
    if v is None:
        raise bad_request(f"'{name}' must be an integer", name, "invalid_type")
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad_request(f"'{name}' must be {rng}, got {v}", name)
    return v


def _top_k(body: dict[str, Any], vocab_size: int) -> int:
    """top_k, 0 for off (vLLM: -1 too); one of at least the vocabulary keeps every token, so it
    is off as well (and a number too large for the bus's msgpack never reaches it)."""
    k = max(0, _int(body, "top_k", 0, -1) or 0)
    return 0 if k >= vocab_size else k


def _num(body: dict[str, Any], name: str, default: float) -> float:
    v = _get(body, name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise bad_request(f"'{name}' must be a finite number", name, "invalid_type")
    return float(v)


def _str(body: dict[str, Any], name: str) -> str | None:
    v = _get(body, name)
    if v is not None and not isinstance(v, str):
        raise bad_request(f"'{name}' must be a string", name, "invalid_type")
    return v


def _bool(body: dict[str, Any], name: str, default: bool) -> bool:
    v = _get(body, name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad_request(f"'{name}' must be a boolean", name, "invalid_type")
    return v


def _only(body: dict[str, Any], name: str, allowed: tuple[Any, ...], why: str) -> None:
    v = _get(body, name)
    if v is not None and v not in allowed:
        raise unsupported(name, f"'{name}'={v!r} is not supported: {why}")


def _stop(body: dict[str, Any]) -> tuple[str, ...]:
    v = _get(body, "stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) and s for s in items):
        raise bad_request("'stop' must be a non-empty string or a list of them", "stop")
    return tuple(items)


def _token_list(v: list[Any], name: str, vocab: int) -> list[int]:
    ids = [_as_int(t) for t in v]
    if any(t is None for t in ids):
        raise bad_request(f"'{name}' token ids must be integers", name, "invalid_type")
    checked = [t for t in ids if t is not None]
    if any(not 0 <= t < vocab for t in checked):
        raise bad_request(f"'{name}' token ids must be in [0, {vocab})", name)
    return checked


# ---- requests --------------------------------------------------------------------------------


def check_model(body: dict[str, Any], info: ModelInfo) -> str:
    model = _get(body, "model")
    if model is None:
        return info.name
    if not isinstance(model, str):
        raise bad_request("'model' must be a string", "model", "invalid_type")
    if not info.accepts(model):
        raise APIError(
            404,
            f"The model `{model}` does not exist. Served: `{info.name}`.",
            "not_found_error",
            "model",
            "model_not_found",
        )
    return info.name


def _common_unsupported(body: dict[str, Any]) -> None:
    _only(body, "presence_penalty", (0, 0.0), "penalties need engine support")
    _only(body, "frequency_penalty", (0, 0.0), "penalties need engine support")
    _only(body, "repetition_penalty", (1, 1.0), "penalties need engine support")
    _only(body, "min_p", (0, 0.0), "min_p sampling is not implemented")
    lb = _get(body, "logit_bias")
    if lb not in (None, {}):
        raise unsupported("logit_bias", "'logit_bias' is not supported")
    if _get(body, "best_of") not in (None, _get(body, "n") or 1):
        raise unsupported("best_of", "'best_of' must equal n (no server-side reranking)")


def _stream_flags(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = _bool(body, "stream", False)
    opts = _get(body, "stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad_request("'stream_options' is only allowed with stream=true", "stream_options")
    if not isinstance(opts, dict):
        raise bad_request("'stream_options' must be an object", "stream_options", "invalid_type")
    include = opts.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_request(
            "'stream_options.include_usage' must be a boolean", "stream_options", "invalid_type"
        )
    return stream, include


def _max_tokens(
    body: dict[str, Any], prompts: list[list[int]], info: ModelInfo, max_tokens: int | None
) -> int:
    """max_tokens as asked, or the room the longest prompt leaves in the context window;
    a 400 when the prompt, or the prompt plus max_tokens, does not fit."""
    longest = max(len(p) for p in prompts)
    room = info.max_model_len - longest
    if room < 1:
        raise bad_request(
            f"the prompt ({longest} tokens) leaves no room in the context window of "
            f"{info.max_model_len} tokens",
            "messages" if "messages" in body else "prompt",
            "context_length_exceeded",
        )
    if max_tokens is None:
        return room
    if longest + max_tokens > info.max_model_len:
        raise bad_request(
            f"prompt ({longest} tokens) plus max_tokens ({max_tokens}) exceeds the context "
            f"window of {info.max_model_len} tokens",
            "max_tokens",
            "context_length_exceeded",
        )
    return max_tokens


def _sampling(
    body: dict[str, Any],
    prompts: list[list[int]],
    info: ModelInfo,
    max_tokens: int | None,
    logprobs: bool,
    top_logprobs: int = 0,
) -> SamplingParams:
    max_tokens = _max_tokens(body, prompts, info, max_tokens)
    stop_ids = _get(body, "stop_token_ids")
    if stop_ids is not None and not isinstance(stop_ids, list):
        raise bad_request("'stop_token_ids' must be a list", "stop_token_ids", "invalid_type")
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=_num(body, "temperature", 1.0),
            top_p=_num(body, "top_p", 1.0),
            top_k=_top_k(body, info.vocab_size),
            seed=_int(body, "seed", None, 0, MAX_SEED),
            n=_int(body, "n", 1, 1, MAX_N) or 1,
            stop=_stop(body),
            stop_token_ids=tuple(_token_list(stop_ids or [], "stop_token_ids", info.vocab_size)),
            ignore_eos=_bool(body, "ignore_eos", False),
            min_tokens=_int(body, "min_tokens", 0, 0) or 0,
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            skip_special_tokens=_bool(body, "skip_special_tokens", True),
        )
    except InvalidRequestError as e:
        raise bad_request(str(e), e.param) from e


def with_fault(plan: GenerationPlan, body: dict[str, Any], allowed: bool) -> GenerationPlan:
    """The plan with the fault its body asks for (`kvserve_fault`, one of FAULTS), which only
    a gateway started with --enable-fault-injection accepts (tests and chaos runs)."""
    fault = body.get("kvserve_fault")
    if fault is None:
        return plan
    if not allowed:
        raise unsupported(
            "kvserve_fault", "'kvserve_fault' needs a server started with --enable-fault-injection"
        )
    if fault not in FAULTS:
        raise bad_request(f"'kvserve_fault' must be one of {list(FAULTS)}", "kvserve_fault")
    return dataclasses.replace(plan, params=dataclasses.replace(plan.params, fault=fault))


def parse_completion(body: dict[str, Any], info: ModelInfo) -> GenerationPlan:
    model = check_model(body, info)
    _common_unsupported(body)
    if _get(body, "echo"):
        raise unsupported("echo", "'echo' is not supported")
    if _get(body, "suffix") is not None:
        raise unsupported("suffix", "'suffix' (insertion) is not supported")
    prompts = _completion_prompts(body.get("prompt"), info)
    # N: the N most likely alternatives per token
    lp = _int(body, "logprobs", None, 0, MAX_COMPLETION_LOGPROBS)
    stream, include_usage = _stream_flags(body)
    max_tokens = _int(body, "max_tokens", 16, 1)
    params = _sampling(body, prompts, info, max_tokens, lp is not None, lp or 0)
    return GenerationPlan(
        "completion",
        model,
        prompts,
        params,
        stream,
        include_usage,
        lp is not None,
        _str(body, "cache_salt"),
        _bool(body, "return_tokens_as_token_ids", False),
        _str(body, "user"),
    )


def _completion_prompts(v: Any, info: ModelInfo) -> list[list[int]]:
    """str | list[str] | list[int] | list[list[int]] -> token ids per prompt."""
    tok = info.tokenizer
    if v is None:
        raise bad_request("'prompt' is required", "prompt", "missing_required_parameter")
    if isinstance(v, str):
        items: list[Any] = [v]
    elif isinstance(v, list) and v and all(_as_int(t) is not None for t in v):
        items = [v]
    elif isinstance(v, list) and v and (_all(v, str) or _all(v, list)):
        items = v
    else:
        raise bad_request(
            "'prompt' must be a non-empty string, list of strings, list of token ids or list "
            "of token id lists",
            "prompt",
        )
    prompts = []
    for item in items:
        ids = (
            _text_prompt(item, tok)
            if isinstance(item, str)
            else _token_list(item, "prompt", info.vocab_size)
        )
        if not ids:
            raise bad_request("'prompt' must not be empty", "prompt")
        prompts.append(ids)
    return prompts


def _text_prompt(text: str, tok: KVTokenizer) -> list[int]:
    """A prompt string's token ids. One of no tokens ("", a few control characters) is the
    document-start token alone: as in OpenAI's legacy completions API, the model generates as
    if from the beginning of a new document (a tokenizer without such a token gives [])."""
    ids = tok.encode(text)
    if ids or tok.document_start_id is None:
        return ids
    return [tok.document_start_id]


def _all(items: list[Any], kind: type) -> bool:
    return all(isinstance(x, kind) for x in items)


def parse_chat(body: dict[str, Any], info: ModelInfo) -> GenerationPlan:
    model = check_model(body, info)
    _common_unsupported(body)
    if _get(body, "tools") not in (None, []) or _get(body, "functions") not in (None, []):
        raise unsupported("tools", "tool calling is not supported")
    rf = _get(body, "response_format")
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") != "text"):
        raise unsupported("response_format", "only response_format {'type': 'text'}")
    ids = chat_prompt(body, info)
    logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, 0, MAX_TOP)
    if top is not None and not logprobs:
        raise bad_request("'top_logprobs' requires logprobs=true", "top_logprobs")
    # Both are checked; the newer name wins when both are given (as in OpenAI's API).
    legacy = _int(body, "max_tokens", None, 1)
    max_tokens = _int(body, "max_completion_tokens", legacy, 1)
    stream, include_usage = _stream_flags(body)
    params = _sampling(body, [ids], info, max_tokens, logprobs, top or 0)
    return GenerationPlan(
        "chat",
        model,
        [ids],
        params,
        stream,
        include_usage,
        logprobs,
        _str(body, "cache_salt"),
        _bool(body, "return_tokens_as_token_ids", False),
        _str(body, "user"),
    )


def parse_tokenize(body: dict[str, Any], info: ModelInfo) -> tuple[list[int], bool]:
    """/tokenize (vLLM's shape): the token ids of exactly one of `prompt` (a string, as it is)
    and `messages` (through the chat template), and whether `return_token_strs` was asked."""
    check_model(body, info)
    token_strs = _bool(body, "return_token_strs", False)
    _bool(body, "add_generation_prompt", True)  # checked whichever input is given
    given = [k for k in ("prompt", "messages") if k in body]
    if len(given) != 1:
        code = "invalid_value" if given else "missing_required_parameter"
        raise bad_request("send exactly one of 'prompt' (a string) and 'messages'", "prompt", code)
    if given[0] == "messages":
        return chat_prompt(body, info), token_strs
    prompt = body["prompt"]
    if not isinstance(prompt, str):
        raise bad_request("'prompt' must be a string", "prompt", "invalid_type")
    return info.tokenizer.encode(prompt), token_strs


def parse_detokenize(body: dict[str, Any], info: ModelInfo) -> list[int]:
    """/detokenize: the token ids in `tokens` (a list, possibly empty)."""
    check_model(body, info)
    ids = body.get("tokens")
    if not isinstance(ids, list):
        raise bad_request("'tokens' must be a list of token ids", "tokens", "invalid_type")
    return _token_list(ids, "tokens", info.vocab_size)


def chat_prompt(body: dict[str, Any], info: ModelInfo) -> list[int]:
    """The token ids of the messages through the chat template."""
    messages = _messages(body.get("messages"))
    add_generation_prompt = _bool(body, "add_generation_prompt", True)
    try:
        text = info.tokenizer.apply_chat_template(messages, add_generation_prompt)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from e
    return list(info.tokenizer.encode(text))


def _messages(v: Any) -> list[dict[str, Any]]:
    if not isinstance(v, list) or not v:
        raise bad_request("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(v):
        if not isinstance(m, dict):
            raise bad_request(f"messages[{i}] must be an object", "messages", "invalid_type")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}", "messages"
            )
        out.append({**m, "role": role, "content": _content(m.get("content"), i)})
    return out


def _content(c: Any, i: int) -> str:
    """A string, null, or a list of text parts (OpenAI's content parts)."""
    if c is None:
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        texts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise unsupported("messages", f"messages[{i}]: only text content parts")
            if not isinstance(part.get("text"), str):
                raise bad_request(f"messages[{i}]: a text part needs 'text'", "messages")
            texts.append(part["text"])
        return "".join(texts)
    raise bad_request(f"messages[{i}].content must be a string or a list", "messages")
