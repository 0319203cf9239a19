"""Schema fuzzing of `kvserve serve`'s HTTP API with schemathesis: the real process, the real
model, requests generated from its own /openapi.json, valid ones and invalid ones (positive and
negative mode), and every check schemathesis has: no server errors, status codes, content types,
response bodies and headers as documented, valid requests accepted and invalid ones refused,
the bearer key enforced, 405 with `Allow` for undocumented methods.

One server for the module, with an API key (so the auth checks have something to check) that
may narrow its cache partition with `cache_salt`, and a memory store (warm-up jobs need one).
The default run is short (few examples per operation, under a minute on two cores); a longer
one is marked slow; both are derandomized, so each run sends the same cases. A random run of
many more examples is marked `fuzz` (`bash ops/test.sh -m fuzz`), outside both suites.

A hook on the generated cases keeps completions to MAX_NEW_TOKENS tokens (the document rightly
allows up to the context window) and min_tokens within them, changing a case only into another
of the same validity.
Prompt strings are sent as generated: one that tokenizes to nothing ("", a few control
characters) runs as the document-start token, as in OpenAI's legacy completions API.
Afterwards the server must still answer an ordinary request and have nothing left running."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import schemathesis
from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.lib.process import ServerProcess
from kvserve.services.bench.lib.readiness import poll_until
from schemathesis import Case, HookContext
from schemathesis.schemas import BaseSchema

from tests.services.server_state import idle

KEY = "fuzz-key"
MAX_NEW_TOKENS = 2  # per generated completion
SHORT_EXAMPLES = 5  # per operation and generation mode
SEEDED_EXAMPLES = 150
RANDOM_EXAMPLES = 500
CHAT = "/v1/chat/completions"
GENERATION = ("/v1/completions", CHAT)


@pytest.fixture(scope="module")
def server(start_server: Callable[..., ServerProcess]) -> ServerProcess:
    return start_server(
        "--store", "memory://",
        "--api-key", KEY,
        "--allow-client-cache-salt",
        "--num-blocks", "512",
    )  # fmt: skip


@pytest.fixture(autouse=True)
def node_id_for_schemathesis(request: pytest.FixtureRequest) -> None:
    """schemathesis (4.32) names each operation's subtest by rewriting the running item's
    `_nodeid`, an attribute pytest 9.2 no longer has: give this module's items one."""
    if not hasattr(request.node, "_nodeid"):
        request.node._nodeid = request.node.nodeid


@pytest.fixture(scope="module")
def http(server: ServerProcess) -> Http:
    return Http(server.url, {"Authorization": f"Bearer {KEY}"})


def is_whole(v: object) -> bool:
    """An integer as JSON Schema sees one: 2 or 2.0, not True."""
    return type(v) is int or (type(v) is float and v.is_integer())


def small_generations(max_model_len: int) -> Callable[[HookContext, Case], Case]:
    """A `map_case` hook: a generation request asks for at most MAX_NEW_TOKENS tokens. Only
    values the document allows are lowered, and a missing limit is added, so a valid case
    stays valid and an invalid one invalid."""

    def hook(context: HookContext, case: Case) -> Case:
        if case.operation.path not in GENERATION or not isinstance(case.body, dict):
            return case
        body: dict[str, Any] = case.body
        names = ["max_tokens"] + (["max_completion_tokens"] if case.operation.path == CHAT else [])
        for name in names:
            if is_whole(body.get(name)) and MAX_NEW_TOKENS < body[name] < max_model_len:
                body[name] = MAX_NEW_TOKENS
        if all(body.get(name) is None for name in names):
            body["max_tokens"] = MAX_NEW_TOKENS
        # min_tokens may not exceed the limit (a rule across two fields, which the document
        # states in words): one above it is lowered to it, so the case stays valid.
        limit = min((body[n] for n in names if is_whole(body.get(n))), default=MAX_NEW_TOKENS)
        if is_whole(body.get("min_tokens")) and body["min_tokens"] > limit >= 0:
            body["min_tokens"] = limit
        return case

    return hook


def load_schema(server: ServerProcess, http: Http, generation: dict[str, Any]) -> BaseSchema:
    config = schemathesis.Config.from_dict(
        {
            "auth": {"openapi": {"bearer": {"bearer": KEY}}},
            "request-timeout": 120,
            "generation": {"database": "none", **generation},
        }
    )
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json", config=config)
    max_model_len = http.get("/v1/models").json()["data"][0]["max_model_len"]
    schema.hook("map_case")(small_generations(max_model_len))
    return schema


@pytest.fixture
def short_schema(server: ServerProcess, http: Http) -> BaseSchema:
    return load_schema(server, http, {"max-examples": SHORT_EXAMPLES, "deterministic": True})


@pytest.fixture
def seeded_schema(server: ServerProcess, http: Http) -> BaseSchema:
    return load_schema(server, http, {"max-examples": SEEDED_EXAMPLES, "deterministic": True})


@pytest.fixture
def random_schema(server: ServerProcess, http: Http) -> BaseSchema:
    return load_schema(server, http, {"max-examples": RANDOM_EXAMPLES})


short = schemathesis.pytest.from_fixture("short_schema")
seeded = schemathesis.pytest.from_fixture("seeded_schema")
random_cases = schemathesis.pytest.from_fixture("random_schema")


def still_serves(http: Http) -> None:
    """An ordinary request is answered, and nothing the fuzzer sent is left running."""
    assert http.get("/ready").status_code == 200
    body = {
        "messages": [{"role": "user", "content": "Name two planets."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    reply = r.json()
    assert reply["choices"][0]["message"]["content"]
    assert reply["usage"]["completion_tokens"] >= 1
    poll_until(lambda: idle(http), timeout=120)


@short.parametrize()
def test_api_matches_its_document(case: Case) -> None:
    case.call_and_validate()


def test_still_serves_after_fuzzing(http: Http) -> None:
    still_serves(http)


@pytest.mark.slow
@pytest.mark.timeout(1800)
@seeded.parametrize()
def test_api_matches_its_document_long(case: Case) -> None:
    case.call_and_validate()


@pytest.mark.fuzz
@pytest.mark.timeout(3600)
@random_cases.parametrize()
def test_api_matches_its_document_random(case: Case) -> None:
    case.call_and_validate()


@pytest.mark.slow
@pytest.mark.fuzz
def test_still_serves_after_long_fuzzing(http: Http) -> None:
    still_serves(http)
