"""One bad request against a real `kvserve serve` (the real model, the in-process bus and
worker, the real `openai` client), started with `--enable-fault-injection`: a request that
raises in its own processing fails alone with a 500 naming it, the requests beside it get their
greedy answers and the engine serves on; a request that breaks the step's forward is isolated
and quarantined; repeated failed steps end the process with a non-zero status, /health saying
so first. Without the flag the field is refused."""

from __future__ import annotations

import concurrent.futures
from typing import Any

import openai
import pytest
from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.lib.process import ServerProcess
from kvserve.services.bench.lib.readiness import poll_until
from prometheus_client.parser import text_string_to_metric_families

from tests.services.openai_suite import MODEL, NUM_BLOCKS
from tests.services.server_state import idle

PROMPTS = [f"Question {i}: what is {i} plus {i + 1}?" for i in range(4)]


def metric(http: Http, name: str) -> float:
    text = http.get("/metrics").text
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


def greedy(client: openai.OpenAI, prompt: str, fault: str | None = None) -> Any:
    extra = {"ignore_eos": True, **({"kvserve_fault": fault} if fault else {})}
    try:
        r = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=12, temperature=0, extra_body=extra
        )
    except openai.APIStatusError as e:
        return e
    return r.choices[0].text


@pytest.fixture(scope="module")
def server(start_server) -> ServerProcess:  # type: ignore[no-untyped-def]
    return start_server(
        "--store", "memory://", "--served-model-name", MODEL, "--num-blocks", str(NUM_BLOCKS),
        "--enable-fault-injection",
    )  # fmt: skip


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def calm(client: openai.OpenAI) -> list[str]:
    return [greedy(client, p) for p in PROMPTS]


@pytest.mark.parametrize(("fault", "code"), [("raise", "internal_error"),
                                             ("raise-step", "quarantined")])  # fmt: skip
def test_a_bad_request_fails_alone(
    server: ServerProcess, client: openai.OpenAI, calm: list[str], fault: str, code: str
) -> None:
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS) + 1) as pool:
        bad = pool.submit(greedy, client, "A poisoned question.", fault)
        good = [pool.submit(greedy, client, p) for p in PROMPTS]
        answers = [f.result() for f in good]
        err = bad.result()
    assert answers == calm
    assert isinstance(err, openai.InternalServerError)
    body = err.body if isinstance(err.body, dict) else {}
    assert body.get("code") == code and body.get("type") == "server_error"
    assert "cmpl-" in body.get("message", "")  # names the request
    http = Http(server.url)
    assert http.get("/health").status_code == 200
    totals = poll_until(lambda: idle(http), 30, "the server to go idle")
    assert totals["num_used_blocks"] == 0
    assert greedy(client, PROMPTS[0]) == calm[0]  # the engine serves on
    counter = "requests_failed" if code == "internal_error" else "requests_quarantined"
    assert metric(http, f"kvserve:{counter}_total") >= 1


def test_the_fault_field_is_refused_without_the_flag(start_server) -> None:  # type: ignore[no-untyped-def]
    plain = start_server("--store", "memory://", "--served-model-name", MODEL,
                         "--num-blocks", str(NUM_BLOCKS))  # fmt: skip
    client = openai.OpenAI(base_url=plain.url + "/v1", api_key="none", max_retries=0)
    err = greedy(client, "hello", "kill")
    assert isinstance(err, openai.BadRequestError)
    assert isinstance(err.body, dict) and err.body.get("param") == "kvserve_fault"
    assert plain.running


def test_repeated_failed_steps_end_the_process(start_server) -> None:  # type: ignore[no-untyped-def]
    """Each poisoned forward fails two steps (its batch's, then its own alone): three of them
    pass the five failed steps a minute that the engine tolerates."""
    server = start_server("--store", "memory://", "--served-model-name", MODEL,
                          "--num-blocks", str(NUM_BLOCKS), "--enable-fault-injection")  # fmt: skip
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    errors = [greedy(client, f"Poison {i}.", "raise-step") for i in range(3)]
    assert all(isinstance(e, openai.APIStatusError) for e in errors)
    assert server.wait(60) != 0
    assert any("the engine failed" in line for line in server.lines())
