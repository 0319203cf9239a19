"""Tokenizer and chat template, from a GGUF file or a Hugging Face directory. Never imports torch.

The GGUF vocabulary (a byte-level BPE, `tokenizer.ggml.model == "gpt2"`) is rebuilt as a
`tokenizers.Tokenizer` the way Hugging Face's GGUF converter does, so token ids match
`AutoTokenizer.from_pretrained(dir, gguf_file=...)`.

A byte-level BPE spells each token's bytes with GPT-2's byte alphabet (one printable character
per byte, `BYTE_OF_CHAR`), so a token that holds part of a multi-byte UTF-8 character decodes
to U+FFFD on its own; `token_bytes` gives its own bytes (what OpenAI's logprobs call `bytes`).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

_CONTROL_TOKEN_TYPE = 3
_USER_DEFINED_TOKEN_TYPE = 4
ENDOFTEXT = "<|endoftext|>"
_SURROGATE = re.compile("[\ud800-\udfff]")


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's `bytes_to_unicode`, inverted: the printable bytes ('!'..'~', '¡'..'¬',
    '®'..'ÿ') stand for themselves, the other 68 in byte order for chr(256), chr(257), ...
    (`tokenizers` applies the same table but does not expose it; transformers is not a runtime
    dependency.)"""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    others = [b for b in range(256) if b not in printable]
    table = {chr(b): b for b in printable}
    table.update({chr(256 + i): b for i, b in enumerate(others)})
    return table


BYTE_OF_CHAR = _byte_alphabet()  # byte-level BPE token character -> the byte it stands for


class ChatTemplateError(ValueError):
    """The chat template rejected the messages (for example a role it does not know)."""


@dataclass(frozen=True)
class TokenizerInfo:
    bos_token: str | None
    eos_token: str | None
    eos_token_ids: tuple[int, ...]
    chat_template: str | None


class KVTokenizer:
    """Encodes text, decodes ids (also incrementally), renders the chat template."""

    def __init__(self, tok: Tokenizer, info: TokenizerInfo) -> None:
        self._tok = tok
        self.info = info
        self.eos_token_ids = info.eos_token_ids
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.byte_level = isinstance(tok.decoder, decoders.ByteLevel)
        self.document_start_id = _document_start_id(tok, info)
        self.fingerprint = hashlib.sha256(tok.to_str().encode()).hexdigest()
        self._template = None
        if info.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(info.chat_template)

    @classmethod
    def from_path(cls, path: str | Path) -> KVTokenizer:
        p = Path(path)
        if p.is_file() and p.suffix == ".gguf":
            return cls.from_gguf(p)
        return cls.from_hf_dir(p)

    @classmethod
    def from_gguf(cls, path: Path) -> KVTokenizer:
        from kvserve.shared.model.gguf_file import open_gguf

        reader = open_gguf(str(path.resolve()))
        fields = reader.fields
        kind = fields["tokenizer.ggml.model"].contents()
        if kind != "gpt2":
            raise ValueError(f"unsupported GGUF tokenizer model {kind!r} (only byte-level BPE)")
        tokens: list[str] = fields["tokenizer.ggml.tokens"].contents()
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]
        types: list[int] = fields["tokenizer.ggml.token_type"].contents()
        vocab = {t: i for i, t in enumerate(tokens)}
        tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        tok.decoder = decoders.ByteLevel()
        special = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types, strict=True)
            if ty in (_CONTROL_TOKEN_TYPE, _USER_DEFINED_TOKEN_TYPE)
        ]
        tok.add_special_tokens(special)

        def _tok_at(key: str) -> str | None:
            f = fields.get(key)
            return None if f is None else tokens[int(f.contents())]

        eos_field = fields.get("tokenizer.ggml.eos_token_id")
        template_field = fields.get("tokenizer.chat_template")
        info = TokenizerInfo(
            bos_token=_tok_at("tokenizer.ggml.bos_token_id"),
            eos_token=_tok_at("tokenizer.ggml.eos_token_id"),
            eos_token_ids=() if eos_field is None else (int(eos_field.contents()),),
            chat_template=None if template_field is None else template_field.contents(),
        )
        return cls(tok, info)

    @classmethod
    def from_hf_dir(cls, path: Path) -> KVTokenizer:
        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        cfg: dict[str, Any] = {}
        if (path / "tokenizer_config.json").exists():
            cfg = json.loads((path / "tokenizer_config.json").read_text())
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").exists():
            template = (path / "chat_template.jinja").read_text()

        def _content(v: Any) -> str | None:
            return v.get("content") if isinstance(v, dict) else v

        eos = _content(cfg.get("eos_token"))
        eos_id = tok.token_to_id(eos) if eos else None
        info = TokenizerInfo(
            bos_token=_content(cfg.get("bos_token")),
            eos_token=eos,
            eos_token_ids=() if eos_id is None else (eos_id,),
            chat_template=template if isinstance(template, str) else None,
        )
        return cls(tok, info)

    def encode(self, text: str) -> list[int]:
        """The text's token ids (no special token added). A lone surrogate (JSON's "\\ud800",
        which UTF-8 cannot encode) is read as U+FFFD, as a UTF-8 decoder reads a bad byte."""
        return list(self._tok.encode(_well_formed(text), add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        tok = self._tok.id_to_token(token_id)
        return None if tok is None else str(tok)

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes, as decoding a sequence joins them (a partial UTF-8 character
        stays partial). Byte-level BPE: its characters through `BYTE_OF_CHAR`, or, as the
        `tokenizers` ByteLevel decoder does, its text's UTF-8 when one is not in that alphabet
        (an added token whose text has a space, say). Another decoder: the UTF-8 of the token
        decoded on its own."""
        tok = self.id_to_token(token_id) if self.byte_level else None
        if tok is None:
            return self.decode([token_id], skip_special_tokens=False).encode("utf-8")
        if all(c in BYTE_OF_CHAR for c in tok):
            return bytes(BYTE_OF_CHAR[c] for c in tok)
        return tok.encode("utf-8")

    def apply_chat_template(
        self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str:
        if self._template is None:
            raise ChatTemplateError("this model has no chat template; send a raw prompt")
        try:
            return str(
                self._template.render(
                    messages=list(messages),
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.info.bos_token or "",
                    eos_token=self.info.eos_token or "",
                )
            )
        except ChatTemplateError:
            raise
        except Exception as e:  # a template error is the caller's input, not ours
            raise ChatTemplateError(f"chat template failed: {e}") from e

    def encode_chat(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        return self.encode(self.apply_chat_template(messages))


def _document_start_id(tok: Tokenizer, info: TokenizerInfo) -> int | None:
    """The token a new document starts after: `<|endoftext|>` where the vocabulary has it (the
    separator of the documents GPT-2-style models such as SmolLM2 and Qwen2 were trained on, and
    what OpenAI's completions API takes an empty prompt to be), else BOS, else the first EOS;
    None for a tokenizer with none of them."""
    for token in (ENDOFTEXT, info.bos_token):
        token_id = None if token is None else tok.token_to_id(token)
        if token_id is not None:
            return int(token_id)
    return info.eos_token_ids[0] if info.eos_token_ids else None


def _well_formed(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD (a pair of surrogates joined)."""
    if not _SURROGATE.search(text):
        return text
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def _raise_template_error(message: str) -> None:
    raise ChatTemplateError(message)


class IncrementalDetokenizer:
    """Turns a growing list of ids into text deltas without splitting a UTF-8 character.

    vLLM's scheme: only the last few tokens are re-decoded each time (from `_prefix` on), and a
    delta is emitted once it no longer ends in the replacement character (an incomplete
    multi-byte sequence). Cost per token is O(window), not O(length).
    """

    def __init__(self, tokenizer: KVTokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # start of the window that is re-decoded
        self._read = 0  # ids before this have been emitted as text
        self._emitted = ""

    @property
    def text(self) -> str:
        return self._emitted

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._tok.decode(self._ids[self._prefix : self._read], self._skip)
        new_text = self._tok.decode(self._ids[self._prefix :], self._skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix, self._read = self._read, len(self._ids)
        self._emitted += delta
        return delta
