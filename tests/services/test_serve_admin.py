"""Cache admin and limits of `kvserve serve`, end to end on the real process: warm-up jobs
(`POST /v1/cache/warmup`, its status endpoint, `kvserve warmup FILE --server URL`), the prefix
cache flush (also at vLLM's /reset_prefix_cache), per-key rate limiting (429 + Retry-After) and
top-k logprobs in OpenAI's shapes (chat `bytes`: each token's own).

Two servers: one with a memory:// store (warm-up needs a store), one without a store (so a
flushed prefix cannot come back from the store) and with a rate limit."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import openai
import pytest
from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.lib.process import ServerProcess
from kvserve.services.bench.lib.readiness import poll_until
from kvserve.services.gateway.prefixes import prefix_ids
from kvserve.shared.model.tokenizer import KVTokenizer
from prometheus_client.parser import text_string_to_metric_families

from tests.services.server_state import idle

MODEL = "kvtest-admin"
BLOCK = 16
ERROR_KEYS = {"message", "type", "param", "code"}
STORE_KEYS = ("store-key-one", "store-key-two")
LIMIT_KEYS = ("limit-key-one", "limit-key-two", "limit-key-three")
RATE = 5  # requests per second per key on the store-less server


@pytest.fixture(scope="module")
def store_server(start_server) -> ServerProcess:
    return start_server(
        "--store", "memory://", "--served-model-name", MODEL, "--num-blocks", "256",
        "--api-key", STORE_KEYS[0], "--api-key", STORE_KEYS[1],
    )  # fmt: skip


@pytest.fixture(scope="module")
def bare_server(start_server) -> ServerProcess:
    return start_server(
        "--store", "none", "--served-model-name", MODEL, "--num-blocks", "256",
        *(arg for key in LIMIT_KEYS for arg in ("--api-key", key)),
        "--rate-limit", f"{RATE}/s",
    )  # fmt: skip


def http_for(server: ServerProcess, key: str) -> Http:
    return Http(server.url, {"Authorization": f"Bearer {key}"})


def client_for(server: ServerProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)


def finished_job(http: Http, job_id: str) -> dict[str, Any] | None:
    r = http.get(f"/v1/cache/warmup/{job_id}")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body if body["status"] != "running" else None


def chat_cached(client: openai.OpenAI, system: str, question: str) -> int:
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=1,
        temperature=0,
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens_details.cached_tokens or 0


# ---- warm-up jobs ----------------------------------------------------------------------------


def test_warmup_job_then_chat_reports_cached(
    store_server: ServerProcess, tokenizer: KVTokenizer
) -> None:
    http = http_for(store_server, STORE_KEYS[0])
    system = f"[{uuid.uuid4().hex}] " + "You are a terse assistant for warm-up tests. " * 8
    r = http.post("/v1/cache/warmup", json={"prefixes": [{"system": system}]})
    assert r.status_code == 202, r.text
    job = r.json()
    assert job["status"] == "running" and job["total"] == 1 and job["id"]
    done = poll_until(lambda: finished_job(http, job["id"]), timeout=120)
    full_blocks = len(prefix_ids(tokenizer, {"system": system})) // BLOCK
    assert done["status"] == "completed", done
    assert done["done"] == 1 and done["computed"] == 1 and done["skipped"] == 0
    # (the computing request publishes its blocks itself; `published` counts what the job
    # then had to add)
    assert done["blocks"] == full_blocks and 0 <= done["published"] <= full_blocks
    assert "error" not in done
    cached = chat_cached(client_for(store_server, STORE_KEYS[0]), system, "Hello?")
    assert cached >= full_blocks * BLOCK
    # The key's cache salt applied: another key's partition does not hold the prefix.
    assert chat_cached(client_for(store_server, STORE_KEYS[1]), system, "Hello?") == 0
    # The store's put latencies are on /metrics (histogram + error counter).
    families = {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}
    put = {s.name: s.value for s in families["kvserve:store_put_seconds"].samples}
    assert put["kvserve:store_put_seconds_count"] >= 1
    assert put["kvserve:store_put_seconds_sum"] > 0
    assert "kvserve:store_errors" in families


def test_warmup_cli_against_the_server(store_server: ServerProcess, tmp_path: Path) -> None:
    jobs = tmp_path / "prefixes.jsonl"
    tag = uuid.uuid4().hex
    jobs.write_text(
        json.dumps({"text": f"[{tag}] Few-shot examples follow. " * 12})
        + "\n"
        + json.dumps({"messages": [{"role": "system", "content": f"[{tag}] Be kind. " * 20}]})
        + "\n"
    )

    def run() -> dict[str, Any]:
        r = subprocess.run(
            [sys.executable, "-m", "kvserve.services.cli", "warmup", str(jobs),
             "--server", store_server.url, "--api-key", STORE_KEYS[0]],
            capture_output=True, text=True, timeout=180,
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        out: dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
        return out

    first = run()
    assert first["status"] == "completed" and first["done"] == first["total"] == 2
    assert first["computed"] == 2 and first["blocks"] > 0
    again = run()  # everything is stored already
    assert again["status"] == "completed" and again["skipped"] == 2 and again["published"] == 0


def test_warmup_bad_bodies(store_server: ServerProcess) -> None:
    http = http_for(store_server, STORE_KEYS[0])
    bad: list[Any] = [
        {},
        {"prefixes": []},
        {"prefixes": "You are helpful."},
        {"prefixes": [{"text": ""}]},
        {"prefixes": [{"text": "a", "system": "b"}]},
        {"prefixes": [{"messages": [{"role": "system"}]}]},
        {"prefixes": [{"prompt": "x"}]},
        {"prefixes": [{"system": "x", "cache_salt": 5}]},
        {"prefixes": [{"system": "x", "cache_salt": "mine"}]},  # salt comes from the key
    ]
    for body in bad:
        r = http.post("/v1/cache/warmup", json=body)
        assert r.status_code == 400, (body, r.text)
        assert set(r.json()["error"]) == ERROR_KEYS
    r = http.post("/v1/cache/warmup", content=b"{nope", headers={"Content-Type": "x"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    r = http.get("/v1/cache/warmup/warmup-nope")
    assert r.status_code == 404 and set(r.json()["error"]) == ERROR_KEYS
    assert Http(store_server.url).post("/v1/cache/warmup", json={}).status_code == 401
    # Shorter than one block: accepted, then the job fails with the worker's reason.
    r = http.post("/v1/cache/warmup", json={"prefixes": [{"text": "hi"}]})
    assert r.status_code == 202
    failed = poll_until(lambda: finished_job(http, r.json()["id"]), timeout=60)
    assert failed["status"] == "failed" and "at least 16 tokens" in failed["error"]


# ---- flush -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "key"),
    [("/v1/cache/flush", LIMIT_KEYS[0]), ("/reset_prefix_cache", LIMIT_KEYS[2])],
)
def test_flush_drops_the_prefix_cache(bare_server: ServerProcess, path: str, key: str) -> None:
    """The flush, and vLLM's POST /reset_prefix_cache (aiperf's --reset-kv-cache) as the same
    flush behind the same key. Each path with a key of its own: a rate-limit bucket of its own."""
    http = http_for(bare_server, key)
    client = client_for(bare_server, key)
    prompt = f"[{uuid.uuid4().hex}] " + "A preamble that the flush must forget. " * 8

    def cached() -> int:
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        return r.usage.prompt_tokens_details.cached_tokens or 0

    assert Http(bare_server.url).post(path).status_code == 401
    assert cached() == 0
    assert cached() >= 3 * BLOCK
    poll_until(lambda: idle(http), timeout=30)
    r = http.post(path)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "cache.flush" and body["flushed"] is True
    assert body["device_blocks"] >= 3 and body["host_blocks"] == 0 and body["workers"]
    assert cached() == 0
    assert http_for(bare_server, "wrong").post(path).status_code == 401


# ---- rate limit ------------------------------------------------------------------------------


def test_rate_limit_429_per_key(bare_server: ServerProcess) -> None:
    http = http_for(bare_server, LIMIT_KEYS[1])
    statuses = []
    limited = None
    for _ in range(3 * RATE):
        r = http.post("/v1/completions", json={})  # invalid: answered at once
        statuses.append(r.status_code)
        if r.status_code == 429:
            limited = r
            break
    assert limited is not None, statuses
    assert set(statuses[:-1]) == {400} and len(statuses) > RATE - 1
    err = limited.json()["error"]
    assert set(err) == ERROR_KEYS and err["code"] == "rate_limit_exceeded"
    assert err["type"] == "rate_limit_error"
    assert int(limited.headers["Retry-After"]) >= 1
    with pytest.raises(openai.RateLimitError):
        client_for(bare_server, LIMIT_KEYS[1]).completions.create(
            model=MODEL, prompt="hi", max_tokens=1
        )
    # Another key has its own bucket; GETs are not limited.
    assert http_for(bare_server, LIMIT_KEYS[0]).post("/v1/completions", json={}).status_code == 400
    assert http.get("/v1/models").status_code == 200
    # The bucket refills.
    poll_until(lambda: http.post("/v1/completions", json={}).status_code == 400, timeout=5,
               interval=0.25)  # fmt: skip


# ---- top-k logprobs --------------------------------------------------------------------------


def test_top_logprobs_openai_shapes(store_server: ServerProcess) -> None:
    # The server without a rate limit: these 4 requests can finish within a second.
    client = client_for(store_server, STORE_KEYS[0])
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
    content = r.choices[0].logprobs.content
    assert len(content) == 4
    for t in content:
        assert len(t.top_logprobs) == 3
        alts = [a.logprob for a in t.top_logprobs]
        assert alts == sorted(alts, reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert t.logprob == pytest.approx(max(alts), abs=1e-6)
        assert t.top_logprobs[0].token == t.token
    c = client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=3, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert lp is not None and lp.top_logprobs is not None and lp.token_logprobs is not None
    assert len(lp.top_logprobs) == len(lp.token_logprobs) == 3
    for top, chosen, tok in zip(lp.top_logprobs, lp.token_logprobs, lp.tokens or [], strict=True):
        assert 1 <= len(top) <= 2
        assert chosen == pytest.approx(max(top.values()), abs=1e-6)
        assert top[tok] == pytest.approx(chosen, abs=1e-6)
    # Streaming carries them too; out of range is a 400.
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a colour."}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed = [
        t for ch in stream if ch.choices and ch.choices[0].logprobs
        for t in ch.choices[0].logprobs.content or []
    ]  # fmt: skip
    assert [t.top_logprobs[0].token for t in streamed] == [t.token for t in content]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            max_tokens=1,
            logprobs=True,
            top_logprobs=21,
        )


def test_chat_logprob_bytes_join_into_the_content(
    store_server: ServerProcess, tokenizer: KVTokenizer
) -> None:
    """An emoji comes out in tokens that each hold part of its UTF-8: `token` reads U+FFFD,
    `bytes` are the token's own (those of its id), and joined they decode to the content."""
    client = client_for(store_server, STORE_KEYS[0])
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Reply with only this emoji: 🙂"}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"return_tokens_as_token_ids": True},
    )
    content = r.choices[0].message.content or ""
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
    entries = r.choices[0].logprobs.content
    assert b"".join(bytes(e.bytes or []) for e in entries).decode() == content
    assert not content.isascii()  # the model answers with an emoji
    ids = [int(e.token.removeprefix("token_id:")) for e in entries]
    partial = [e for e, t in zip(entries, ids, strict=True) if "\ufffd" in tokenizer.decode([t])]
    assert partial and all(e.bytes != [239, 191, 189] for e in partial)
    for e, t in zip(entries, ids, strict=True):
        assert e.bytes == list(tokenizer.token_bytes(t))
        for a in e.top_logprobs:
            assert a.bytes == list(tokenizer.token_bytes(int(a.token.removeprefix("token_id:"))))
