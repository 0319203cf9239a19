"""NVIDIA's aiperf benchmark client against `kvserve serve`, unchanged: tools written for vLLM's
and OpenAI's conventions (`max_completion_tokens` / `max_tokens`, SSE with
`stream_options.include_usage`, the `usage` counts, vLLM's `ignore_eos` extra and its
`POST /reset_prefix_cache`, Bearer keys, a Prometheus `/metrics`) must work against kvserve as
they do against vLLM.

A fixed workload per endpoint (chat streamed, completions not): 16 synthetic prompts of 64
tokens, 4 in flight, 16 output tokens each (stddev 0, `ignore_eos`, greedy, a fixed seed),
behind an API key, the prefix cache reset first. Asserted from aiperf's own exports: 16
requests, none failed, every output 16 tokens, the reset reached the server, aiperf read
kvserve's /metrics.

Output lengths are the server's counts (`--use-server-token-count`): aiperf's default recount
re-tokenizes the text, and a greedy output such as "O", "th", "ol", "lo" re-tokenizes shorter
than it was generated.

aiperf is not a dev dependency: every release pins `huggingface-hub<2`, which would downgrade
transformers (and prometheus-client, pillow, psutil, rich) in the project's environment. It
runs from a virtual environment of its own, made once with pip under kvserve's cache directory
(PyPI needed the first time), or from the `aiperf` that KVSERVE_AIPERF names."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.lib.process import ServerProcess
from kvserve.services.bench.lib.readiness import poll_until
from kvserve.shared.config import cache_dir

from tests.services.server_state import idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first run installs aiperf

AIPERF_VERSION = "0.13.0"
MODEL = "kvtest-aiperf"
KEY = "aiperf-key"
REQUESTS, CONCURRENCY, INPUT_LEN, OUTPUT_LEN = 16, 4, 64, 16
AIPERF_TIMEOUT_S = 240


def install_aiperf() -> Path:
    """aiperf's executable: KVSERVE_AIPERF, else a venv of its own under the cache directory,
    made on first use (under a lock; a marker file says it completed)."""
    given = os.environ.get("KVSERVE_AIPERF")
    if given:
        return Path(given)
    venv = cache_dir() / "tools" / f"aiperf-{AIPERF_VERSION}"
    exe, done = venv / "bin" / "aiperf", venv / ".installed"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with (venv.parent / f"{venv.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            steps = [
                [sys.executable, "-m", "venv", "--clear", str(venv)],
                [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
                 "--disable-pip-version-check", f"aiperf=={AIPERF_VERSION}"],
            ]  # fmt: skip
            for cmd in steps:
                r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                if r.returncode != 0:
                    pytest.fail(
                        f"installing aiperf {AIPERF_VERSION} into {venv} failed (PyPI "
                        f"unreachable? KVSERVE_AIPERF can name an installed aiperf):\n"
                        f"$ {' '.join(cmd)}\n{(r.stdout + r.stderr)[-3000:]}"
                    )
            done.touch()
    return exe


@pytest.fixture(scope="module")
def aiperf() -> Path:
    return install_aiperf()


@pytest.fixture(scope="module")
def hf_tokenizer(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The served model's tokenizer as a Hugging Face tokenizer directory (aiperf sizes its
    synthetic prompts with it): exported from the GGUF file by transformers."""
    if model_path.is_dir():
        return model_path
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("hf-tokenizer")
    tok = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def server(start_server) -> ServerProcess:
    return start_server(
        "--store", "memory://", "--served-model-name", MODEL, "--num-blocks", "256",
        "--api-key", KEY,
    )  # fmt: skip


def aiperf_command(
    aiperf: Path, server: ServerProcess, tokenizer: Path, endpoint: str, stream: bool, out: Path
) -> list[str]:
    return [
        str(aiperf), "profile",
        "--model", MODEL, "--url", server.url, "--api-key", KEY,
        "--endpoint-type", endpoint, *(["--streaming"] if stream else []),
        "--tokenizer", str(tokenizer),
        "--request-count", str(REQUESTS), "--concurrency", str(CONCURRENCY),
        "--synthetic-input-tokens-mean", str(INPUT_LEN), "--synthetic-input-tokens-stddev", "0",
        "--output-tokens-mean", str(OUTPUT_LEN), "--output-tokens-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
        "--random-seed", "0",
        "--reset-kv-cache",
        "--use-server-token-count",
        "--no-gpu-telemetry", "--ui-type", "none",
        "--artifact-dir", str(out),
    ]  # fmt: skip


def flushes(server: ServerProcess) -> int:
    """The gateway's flush answers so far (one per POST /reset_prefix_cache or /v1/cache/flush)."""
    return sum(
        1 for e in server.events() if e.get("event") == "prefix cache flushed" and "workers" in e
    )


@pytest.mark.parametrize(
    ("endpoint", "stream"),
    [("chat", True), ("completions", False)],
    ids=["chat-stream", "completions"],
)
def test_aiperf_profile(
    aiperf: Path,
    hf_tokenizer: Path,
    server: ServerProcess,
    tmp_path: Path,
    endpoint: str,
    stream: bool,
) -> None:
    poll_until(lambda: idle(Http(server.url, {"Authorization": f"Bearer {KEY}"})))
    flushed_before = flushes(server)
    out = tmp_path / "aiperf"
    cmd = aiperf_command(aiperf, server, hf_tokenizer, endpoint, stream, out)
    # aiperf 0.13 in HF offline mode looks a tokenizer directory up as a hub cache entry (and
    # fails); online, a local directory never reaches the hub.
    dropped = ("PYTHONPATH", "VIRTUAL_ENV", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(NO_COLOR="1", COLUMNS="160")
    done = subprocess.run(
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=AIPERF_TIMEOUT_S
    )
    export = out / "profile_export.jsonl"
    records = [json.loads(line) for line in export.open()] if export.exists() else []
    failed = [r["error"] for r in records if r.get("error")]
    assert done.returncode == 0 and not failed, (
        f"aiperf exited with {done.returncode}; failed requests: {failed[:3]}\n"
        f"{(done.stdout + done.stderr)[-4000:]}\nserver:\n{server.tail(30)}"
    )

    summary: dict[str, Any] = json.loads((out / "profile_export_aiperf.json").read_text())
    assert summary["is_complete"] and not summary["was_cancelled"]
    assert summary["error_summary"] == []
    assert summary["request_count"]["avg"] == REQUESTS
    assert summary["request_error_rate"]["avg"] == 0
    osl = summary["output_sequence_length"]
    assert (osl["count"], osl["min"], osl["max"]) == (REQUESTS, OUTPUT_LEN, OUTPUT_LEN), osl

    assert len(records) == REQUESTS
    for r in records:
        m = r["metrics"]
        assert m["output_sequence_length"]["value"] == OUTPUT_LEN, r
        assert m["usage_completion_tokens"]["value"] == OUTPUT_LEN, r
        if stream:  # the first token came before the last
            assert 0 < m["time_to_first_token"]["value"] < m["request_latency"]["value"], r

    assert flushes(server) > flushed_before  # --reset-kv-cache reached /reset_prefix_cache
    scraped = json.loads((out / "server_metrics_export.json").read_text())
    assert scraped["summary"]["endpoints_successful"] == [server.url + "/metrics"]
    assert any(name.startswith("kvserve:") for name in scraped["metrics"])
