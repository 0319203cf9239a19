"""`kvserve serve` with API keys, a one-request queue and a small body limit: 401, per-key cache
partitions, 413, 503 with Retry-After, and the SIGTERM drain (last: it stops the server)."""

from __future__ import annotations

import subprocess
import sys
import uuid
from typing import Any

import openai
import pytest

from tests.services.kvserve_process import Http, ServeProcess, poll_until

KEYS = ("key-one", "key-two")
BODY_LIMIT = 4096
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def server(start_server) -> ServeProcess:  # type: ignore[no-untyped-def]
    return start_server(
        "--store", "memory://",
        "--api-key", KEYS[0], "--api-key", KEYS[1],
        "--max-queue", "1",
        "--max-body-bytes", str(BODY_LIMIT),
        "--num-blocks", "128",
        "--drain-timeout", "60",
    )  # fmt: skip


def client(server: ServeProcess, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def http(server: ServeProcess, key: str | None = KEYS[0]) -> Http:
    return Http(server.url, {"Authorization": f"Bearer {key}"} if key else {})


def quiet(server: ServeProcess) -> bool:
    """Nothing in flight at the gateway (the one queue slot is free)."""
    return bool(http(server).get("/v1/cache/stats").json()["gateway"]["in_flight"] == 0)


def long_stream(c: openai.OpenAI) -> Any:
    return c.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Count: one, two,",
        max_tokens=1000,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )


def test_bad_serve_arguments_are_one_line_errors() -> None:
    for args in (["--max-queue", "0"], ["--port", "70000"], ["--api-key", ""]):
        r = subprocess.run(
            [sys.executable, "-m", "kvserve.services.cli", "serve", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr


def test_api_keys(server: ServeProcess) -> None:
    for key in (None, "wrong"):
        r = http(server, key).get("/v1/models")
        assert r.status_code == 401 and set(r.json()["error"]) == ERROR_KEYS
        assert r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").models.list()
    assert http(server, None).get("/health").status_code == 200  # not under /v1
    for key in KEYS:
        assert [m.id for m in client(server, key).models.list().data]


def test_each_key_has_its_own_cache_partition(server: ServeProcess) -> None:
    prompt = f"[{uuid.uuid4().hex}] " + "A long shared preamble about caching. " * 10

    def cached(key: str) -> int:
        r = client(server, key).completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=1, temperature=0
        )
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.usage.prompt_tokens_details.cached_tokens or 0

    assert cached(KEYS[0]) == 0
    assert cached(KEYS[0]) > 0  # same key: the prefix is reused
    assert cached(KEYS[1]) == 0  # another key never sees the first key's blocks
    # A client cache_salt is refused unless the server allows it.
    r = http(server).post("/v1/completions", json={"prompt": "hi", "cache_salt": "mine"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_body_limit_413(server: ServeProcess) -> None:
    r = http(server).post("/v1/completions", json={"prompt": "x" * (BODY_LIMIT + 10)})
    assert r.status_code == 413
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["code"] == "request_too_large"
    ok = client(server).completions.create(
        model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=1, temperature=0
    )
    assert ok.choices[0].text is not None


def test_full_queue_answers_503_with_retry_after(server: ServeProcess) -> None:
    poll_until(lambda: quiet(server))
    c = client(server)
    stream = long_stream(c)
    next(iter(stream))  # the one slot is taken
    with pytest.raises(openai.InternalServerError) as e:
        c.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=1)
    assert e.value.status_code == 503
    assert e.value.response.headers["retry-after"] == "1"
    assert e.value.code == "server_overloaded"
    stream.close()
    poll_until(lambda: quiet(server))
    ok = c.completions.create(model="SmolLM2-135M-Instruct", prompt="hi", max_tokens=1)
    assert ok.choices


def test_sigterm_drains_running_requests(server: ServeProcess) -> None:
    """Runs last in this module: the server stops."""
    poll_until(lambda: quiet(server))
    c = client(server)
    stream = c.completions.create(
        model="SmolLM2-135M-Instruct",
        prompt="Count: one, two,",
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    it = iter(stream)
    first = next(it)
    server.terminate()
    poll_until(lambda: http(server).get("/ready").status_code == 503)
    assert http(server).get("/ready").json() == {"status": "draining"}
    r = http(server).post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"
    assert r.headers["Retry-After"] == "1"
    rest = list(it)  # the running request still finishes
    chunks = [first, *rest]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert rest[-1].usage is not None and rest[-1].usage.completion_tokens == 24
    assert server.wait(60) == 0
    assert any(e.get("event") == "stopped" and e.get("drained") for e in server.events())
