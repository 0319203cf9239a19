"""The chat workloads of `kvserve bench serve` (services/bench/workloads/chat.py): deterministic
under a seed; copy-edit's prompts hold the whole document (as token ids, so that an n-gram lookup
finds it) and end with the answer's first line; the typos; open-ended's prompts; the options
`bench serve` makes them from."""

from __future__ import annotations

import argparse
import random
import re
from pathlib import Path

import pytest
from kvserve.services.bench import serve
from kvserve.services.bench.workloads.chat import (
    DOCUMENTS,
    EDITOR_SYSTEM_PROMPT,
    OPEN_PROMPTS,
    TYPOS_PER_DOCUMENT,
    CopyEdit,
    OpenEnded,
    add_typos,
    edit_prompt,
    prompt_ids,
)
from kvserve.services.bench.workloads.sessions import WORKLOADS
from kvserve.shared.model.tokenizer import KVTokenizer

VOCAB = 49152
TASKS = sum(len(d.edits) for d in DOCUMENTS) + sum(d.kind == "prose" for d in DOCUMENTS)


def contains(haystack: list[int], needle: list[int]) -> bool:
    n = len(needle)
    return any(haystack[i : i + n] == needle for i in range(len(haystack) - n + 1))


def test_the_workloads_are_seeded(tokenizer: KVTokenizer) -> None:
    for chat in (CopyEdit, OpenEnded):
        a = chat(12, 192, tokenizer).sessions(VOCAB, seed=0)
        assert a == chat(12, 192, tokenizer).sessions(VOCAB, seed=0)
        assert a != chat(12, 192, tokenizer).sessions(VOCAB, seed=1)
        assert len(a) == 12
        assert all(len(s.turns) == 1 and s.turns[0].output_len == 192 for s in a)
        assert len({s.user for s in a}) == 12  # one user each: single requests
        assert chat.name in WORKLOADS


def test_documents_are_longer_than_an_answer_and_hold_their_edits(
    tokenizer: KVTokenizer,
) -> None:
    """An answer of the default length ends inside the copy, before the document does."""
    for doc in DOCUMENTS:
        assert len(tokenizer.encode(doc.text)) > serve.CHAT_OUTPUT_LEN + 64, doc.file
        for old, new in doc.edits:
            assert old in doc.text and new not in doc.text, (doc.file, old)
    assert len({d.file for d in DOCUMENTS}) == len(DOCUMENTS)


def test_copy_edit_prompts_hold_the_document_and_start_the_answer(
    tokenizer: KVTokenizer,
) -> None:
    """Every task once: the prompt's ids contain the whole document's ids (typos included) and
    end with the ids of the answer's first line; the editor's system prompt is rendered."""
    sessions = CopyEdit(TASKS, 192, tokenizer).sessions(VOCAB, seed=3)
    rng = random.Random("copy-edit:3")
    prompts = CopyEdit(TASKS, 192, tokenizer).prompts(rng)
    assert len({p.tag for p in prompts}) == TASKS  # every task exactly once
    by_file = {d.file.split(".")[0]: d for d in DOCUMENTS}
    for s, p in zip(sessions, prompts, strict=True):
        ids = s.turns[0].tokens
        assert ids == prompt_ids(tokenizer, p) and s.tag == p.tag
        sent = p.messages[-1]["content"].split("\n\n", 1)[1]  # the document as sent
        doc = by_file[p.tag.split(":")[0]]
        if p.tag.endswith(":proofread"):
            assert sent != doc.text and len(sent) == len(doc.text)
        else:
            assert sent == doc.text
        assert contains(ids, tokenizer.encode(sent)), p.tag
        assert p.answer_start.endswith("\n") and sent.startswith(p.answer_start.split(" ")[0])
        assert ids[-len(tokenizer.encode(p.answer_start)) :] == tokenizer.encode(p.answer_start)
        assert p.messages[0] == {"role": "system", "content": EDITOR_SYSTEM_PROMPT}
        text = tokenizer.decode(ids, skip_special_tokens=False)
        assert EDITOR_SYSTEM_PROMPT in text and text.endswith("assistant\n" + p.answer_start)


def test_the_edit_is_applied_to_the_answers_first_line() -> None:
    doc = next(d for d in DOCUMENTS if d.file == "towns.md.txt")
    p = edit_prompt(doc, ("Sunny days", "Days of sun"), random.Random(0))
    assert p.messages[1]["content"].startswith('Replace "Sunny days" with "Days of sun" in this')
    assert "| Days of sun |" in p.answer_start and "Sunny days" not in p.answer_start
    code = next(d for d in DOCUMENTS if d.kind == "code")
    old, new = code.edits[0]
    instruction = edit_prompt(code, (old, new), random.Random(0)).messages[1]["content"]
    assert instruction.startswith(f"Rename `{old}` to `{new}` in this file:\n\n")


def test_typos_swap_neighbouring_letters_in_distinct_words() -> None:
    text = next(d for d in DOCUMENTS if d.file == "garden_notice.txt").text
    a = add_typos(text, TYPOS_PER_DOCUMENT, random.Random(5))
    assert a == add_typos(text, TYPOS_PER_DOCUMENT, random.Random(5))
    assert a != add_typos(text, TYPOS_PER_DOCUMENT, random.Random(6))
    assert a.split("\n", 1)[0] == text.split("\n", 1)[0]  # the title stays as it is
    words = list(zip(re.findall(r"\S+", text), re.findall(r"\S+", a), strict=True))
    changed = [(w, t) for w, t in words if w != t]
    assert len(changed) == TYPOS_PER_DOCUMENT
    for w, t in changed:
        assert sorted(w) == sorted(t) and w[0] == t[0] and w[-1] == t[-1]
        diff = [i for i, (x, y) in enumerate(zip(w, t, strict=True)) if x != y]
        assert len(diff) == 2 and diff[1] == diff[0] + 1


def test_requests_past_the_last_task_repeat_the_order(tokenizer: KVTokenizer) -> None:
    prompts = CopyEdit(TASKS + 4, 192, tokenizer).prompts(random.Random(0))
    assert [p.tag for p in prompts[TASKS:]] == [p.tag for p in prompts[:4]]
    opened = OpenEnded(len(OPEN_PROMPTS) + 2, 192, tokenizer).prompts(random.Random(0))
    first = [p.messages[0]["content"] for p in opened[: len(OPEN_PROMPTS)]]
    assert sorted(first) == sorted(OPEN_PROMPTS)  # each once before any repeats
    assert all(len(p.messages) == 1 and p.answer_start == "" for p in opened)


def test_a_tokenizer_beyond_the_servers_vocabulary_is_refused(tokenizer: KVTokenizer) -> None:
    with pytest.raises(ValueError, match="not the served model's"):
        OpenEnded(2, 16, tokenizer).sessions(200)


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(["--base-url", "http://127.0.0.1:1", *argv])


def test_bench_serve_options_make_the_chat_workloads(model_path: Path) -> None:
    spec = serve.workload_spec(parse("--workload", "copy-edit"))
    assert isinstance(spec, CopyEdit)
    assert (spec.num_requests, spec.output_len) == (serve.CHAT_REQUESTS, serve.CHAT_OUTPUT_LEN)
    args = parse("--workload", "open-ended", "--num-requests", "40", "--output-len", "128")
    args.tokenizer = str(model_path)
    sessions = serve.build_workload(args, VOCAB)
    assert len(sessions) == 40  # a count, not a cap
    assert {s.turns[0].output_len for s in sessions} == {128}
    random_spec = serve.workload_spec(parse("--workload", "random"))
    assert isinstance(random_spec, serve.RandomLengths) and random_spec.output_len == 64
    missing = parse("--workload", "copy-edit", "--tokenizer", "/nonexistent/model.gguf")
    with pytest.raises(serve.CliError, match="--tokenizer"):
        serve.workload_spec(missing)
