"""The chat workloads of `kvserve bench serve`: real text in the model's chat template, one
user at a time in mind (`--max-concurrency 1`), made to tell decoding that copies from the
prompt (n-gram speculative decoding, vLLM's prompt lookup) from decoding that cannot.

- `copy-edit` (`CopyEdit`): "make this small change and give me the whole document back".
  A document of texts/ (prose, code or a table, 270-390 tokens each, longer than an answer of
  the default length) follows an instruction: replace a name or term, rename an identifier or a
  column, or fix spelling mistakes drawn into it; an editor's system prompt asks for the whole
  document back, and the prompt ends with the answer's first line (the assistant's turn already
  begun, as vLLM's `continue_final_message`), so that greedy answers copy the document.
- `open-ended` (`OpenEnded`): open questions and creative prompts, nothing to copy.

Requests go out as token ids like every workload's: the messages rendered with the chat template
of `tokenizer` (the served model's, so that every server sees the same ids) and encoded.
Deterministic under a seed: the seed orders the tasks, picks the edits and places the typos.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

from kvserve.services.bench.workloads.sessions import SeededWorkload, Session, Turn

TEXTS = Path(__file__).parent / "texts"
EDITOR_SYSTEM_PROMPT = (
    "You are a copy editor. You answer with the user's whole document, changed only as asked."
)
TYPOS_PER_DOCUMENT = 3
_INSTRUCTIONS = {
    "prose": 'Replace "{old}" with "{new}" in this document:',
    "code": "Rename `{old}` to `{new}` in this file:",
    "table": 'Replace "{old}" with "{new}" in this table:',
}
PROOFREAD = "Fix the spelling in this document:"


@dataclass(frozen=True)
class Document:
    """A file of texts/, its kind (the instruction's wording) and the edits asked of it: (old,
    new) pairs, each old string in the file. Prose is also proofread."""

    file: str
    kind: str  # "prose", "code" or "table"
    edits: tuple[tuple[str, str], ...]

    @property
    def text(self) -> str:
        return (TEXTS / self.file).read_text()


DOCUMENTS = (
    Document("garden_notice.txt", "prose", (
        ("Maria Okafor", "Helen Park"), ("shed", "tool hut"), ("wheelbarrow", "garden cart"),
        ("volunteers", "helpers"),
    )),
    Document("library_minutes.txt", "prose", (
        ("council", "city office"), ("Thursday", "Friday"), ("volunteers", "members"),
        ("Daniel", "David"),
    )),
    Document("lentil_soup.txt", "prose", (
        ("red lentils", "yellow split peas"), ("cumin", "coriander"),
        ("olive oil", "sunflower oil"), ("bread", "rice"),
    )),
    Document("inventory.py.txt", "code", (
        ("total_value", "stock_value"), ("low_stock", "items_below"), ("Inventory", "Stock"),
        ("print_report", "show_report"),
    )),
    Document("todo_list.js.txt", "code", (
        ("loadItems", "readItems"), ("saveItems", "writeItems"), ("STORAGE_KEY", "STORE_NAME"),
        ("toggleItem", "flipItem"),
    )),
    Document("towns.md.txt", "table", (
        ("Sunny days", "Days of sun"), ("Main industry", "Largest employer"),
        ("Rainfall (mm)", "Rain (mm)"), ("Coast", "Seaside"),
    )),
)  # fmt: skip

# Our own prompts: nothing in them for an answer to copy.
OPEN_PROMPTS = (
    "Write a story about a clockmaker who builds a clock that runs backwards.",
    "Describe a city on the far side of the Moon in the year 2300.",
    "What would change in everyday life if people needed only two hours of sleep a night?",
    "Write a letter from a lighthouse to the ships that pass it at night.",
    "Invent a new board game for four players and explain how to play it.",
    "Explain why the sky turns red and orange at sunset, as you would to a curious child.",
    "Write a conversation between a cat and a houseplant about who owns the windowsill.",
    "Describe a market in a desert town at dawn: the sounds, the smells and the people.",
    "What are the good and the bad sides of living on a boat all year round?",
    "Write the opening of a mystery novel that takes place on a night train.",
    "Imagine you are an oak tree that has stood for five hundred years. What have you seen?",
    "Plan a week-long cycling trip through the mountains, day by day.",
    "Write a speech for the opening of a new public library in a small town.",
    "Why do people enjoy being frightened by films and stories?",
    "Describe a festival held in a village where it never stops snowing.",
    "Write a fable about a river that wanted to flow uphill.",
    "Give advice to someone who is starting their first vegetable garden.",
    "Invent an animal that lives in the deep ocean and describe a day in its life.",
    "Write the diary of an astronaut on the first day after landing on Mars.",
    "How might schools be different a hundred years from now?",
    "Describe the perfect rainy afternoon at home.",
    "Tell the story of a robot that learns to bake bread.",
    "What makes a good friend? Give examples from everyday life.",
    "Write a guide for a traveller visiting an imaginary island for the first time.",
)


@dataclass(frozen=True)
class ChatPrompt:
    """One request's conversation; `answer_start` is the beginning of the assistant's answer,
    already in the prompt ("" for none)."""

    messages: tuple[dict[str, str], ...]
    answer_start: str = ""
    tag: str = ""


class ChatTokenizer(Protocol):
    def apply_chat_template(self, messages: Sequence[dict[str, Any]]) -> str: ...

    def encode(self, text: str) -> list[int]: ...


def prompt_ids(tokenizer: ChatTokenizer, prompt: ChatPrompt) -> list[int]:
    """The chat template's rendering of the messages (ending with the assistant's turn), then
    the answer's start, encoded together."""
    return tokenizer.encode(tokenizer.apply_chat_template(prompt.messages) + prompt.answer_start)


class ChatWorkload(SeededWorkload):
    """`num_requests` single-turn chat requests of `output_len` tokens each, rendered and
    encoded with `tokenizer`; `prompts(rng)` are their conversations."""

    num_requests: int
    output_len: int
    tokenizer: ChatTokenizer

    def prompts(self, rng: random.Random) -> list[ChatPrompt]:
        raise NotImplementedError

    def draw(self, rng: random.Random, vocab_size: int) -> list[Session]:
        out = []
        for i, p in enumerate(self.prompts(rng)):
            ids = prompt_ids(self.tokenizer, p)
            if max(ids) >= vocab_size:
                raise ValueError(
                    f"token id {max(ids)} of the tokenizer is not below the server's vocabulary "
                    f"size {vocab_size}: the tokenizer is not the served model's"
                )
            out.append(Session([Turn(ids, self.output_len)], tag=p.tag, user=f"{self.prefix}{i}"))
        return out

    prefix: ClassVar[str] = "c"


@dataclass(frozen=True, eq=False)
class CopyEdit(ChatWorkload):
    """Edit requests whose answers copy the document (see the module's docstring). The tasks,
    every (document, edit) pair and a proofreading of each prose document, are shuffled and
    taken in turn; past the last, the order repeats with fresh typos."""

    name: ClassVar[str] = "copy-edit"
    prefix: ClassVar[str] = "e"
    num_requests: int
    output_len: int
    tokenizer: ChatTokenizer

    def prompts(self, rng: random.Random) -> list[ChatPrompt]:
        tasks: list[tuple[Document, tuple[str, str] | None]] = [
            (d, e) for d in DOCUMENTS for e in d.edits
        ]
        tasks += [(d, None) for d in DOCUMENTS if d.kind == "prose"]
        rng.shuffle(tasks)
        return [edit_prompt(*tasks[i % len(tasks)], rng) for i in range(self.num_requests)]


def edit_prompt(doc: Document, edit: tuple[str, str] | None, rng: random.Random) -> ChatPrompt:
    """The request for one edit of `doc` (None: proofreading, with typos drawn from `rng`)."""
    text = doc.text
    title = text.split("\n", 1)[0]
    if edit is None:
        instruction, sent, first = PROOFREAD, add_typos(text, TYPOS_PER_DOCUMENT, rng), title
        tag = f"{doc.file.split('.')[0]}:proofread"
    else:
        old, new = edit
        instruction = _INSTRUCTIONS[doc.kind].format(old=old, new=new)
        sent, first = text, title.replace(old, new)
        tag = f"{doc.file.split('.')[0]}:{old}"
    messages = (
        {"role": "system", "content": EDITOR_SYSTEM_PROMPT},
        {"role": "user", "content": f"{instruction}\n\n{sent}"},
    )
    return ChatPrompt(messages, answer_start=first + "\n", tag=tag)


_WORD = re.compile(r"\b[A-Za-z]{5,}\b")


def add_typos(text: str, n: int, rng: random.Random) -> str:
    """`text` with two neighbouring letters swapped inside each of `n` words (words of five or
    more letters after the first line, each changed, the first and last letters kept)."""
    start = text.index("\n") + 1 if "\n" in text else 0
    words = [
        m for m in _WORD.finditer(text, start) if len(set(m.group()[1:-1])) > 1
    ]  # a word whose inner letters are all the same cannot be changed by a swap
    chars = list(text)
    for m in sorted(rng.sample(words, min(n, len(words))), key=lambda m: m.start()):
        inner = [j for j in range(m.start() + 1, m.end() - 2) if chars[j] != chars[j + 1]]
        j = rng.choice(inner)
        chars[j], chars[j + 1] = chars[j + 1], chars[j]
    return "".join(chars)


@dataclass(frozen=True, eq=False)
class OpenEnded(ChatWorkload):
    """Open questions and creative prompts (OPEN_PROMPTS), shuffled and taken in turn, the
    order repeating past the last; the template's default system prompt."""

    name: ClassVar[str] = "open-ended"
    prefix: ClassVar[str] = "o"
    num_requests: int
    output_len: int
    tokenizer: ChatTokenizer

    def prompts(self, rng: random.Random) -> list[ChatPrompt]:
        order = list(range(len(OPEN_PROMPTS)))
        rng.shuffle(order)
        picks = [order[i % len(order)] for i in range(self.num_requests)]
        return [
            ChatPrompt(({"role": "user", "content": OPEN_PROMPTS[k]},), tag=f"q{k}") for k in picks
        ]
