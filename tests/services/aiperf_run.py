"""NVIDIA's aiperf benchmark client, unchanged, against a kvserve gateway: `kvserve serve`
(tests/services/test_serve_aiperf.py) and the compose stack (tests/services/test_compose_e2e.py).
Tools written for vLLM's and OpenAI's conventions (`max_completion_tokens` / `max_tokens`, SSE
with `stream_options.include_usage`, the `usage` counts, vLLM's `ignore_eos` extra and its
`POST /reset_prefix_cache`, Bearer keys, a Prometheus `/metrics`) must work against kvserve as
they do against vLLM.

One fixed workload (`aiperf_command`): 16 synthetic prompts of 64 tokens, 4 in flight, 16 output
tokens each (stddev 0, `ignore_eos`, greedy, a fixed seed), the prefix cache reset first
(`--reset-kv-cache`). `check_exports` asserts on aiperf's own exports: 16 requests, none failed,
every output 16 tokens, aiperf read the gateway's /metrics (kvserve's families among them).
Whether the reset reached the server is each caller's check: it reads the server's log.

Output lengths are the server's counts (`--use-server-token-count`): aiperf's default recount
re-tokenizes the text, and a greedy output such as "O", "th", "ol", "lo" re-tokenizes shorter
than it was generated.

aiperf is not a dev dependency: every release pins `huggingface-hub<2`, which would downgrade
transformers (and prometheus-client, pillow, psutil, rich) in the project's environment. It
runs from a virtual environment of its own, made once with pip under kvserve's cache directory
(PyPI needed the first time: give a test that may make it a timeout of 900 s), or from the
`aiperf` that KVSERVE_AIPERF names."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from kvserve.shared.config import cache_dir

AIPERF_VERSION = "0.13.0"
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


def export_hf_tokenizer(model_path: Path, out: Path) -> Path:
    """The served model's tokenizer as a Hugging Face tokenizer directory (aiperf sizes its
    synthetic prompts with it): the model's own directory, or exported from the GGUF file by
    transformers into `out`."""
    if model_path.is_dir():
        return model_path
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
    tok.save_pretrained(out)
    return out


def aiperf_command(
    aiperf: Path,
    url: str,
    model: str,
    tokenizer: Path,
    endpoint: str,
    stream: bool,
    out: Path,
    api_key: str | None = None,
) -> list[str]:
    """`aiperf profile` with the fixed workload against the gateway at `url`, exports to `out`."""
    return [
        str(aiperf), "profile",
        "--model", model, "--url", url, *(["--api-key", api_key] if api_key else []),
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


@dataclass
class AiperfRun:
    """One finished `aiperf profile`: its exit status, its output, its artifact directory, and
    the gateway it ran against."""

    returncode: int
    output: str
    out: Path
    url: str


def run_aiperf(cmd: list[str], cwd: Path) -> AiperfRun:
    """Run `cmd` (from `aiperf_command`) in `cwd`, outside the project's environment."""
    # aiperf 0.13 in HF offline mode looks a tokenizer directory up as a hub cache entry (and
    # fails); online, a local directory never reaches the hub.
    dropped = ("PYTHONPATH", "VIRTUAL_ENV", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    env.update(NO_COLOR="1", COLUMNS="160")
    done = subprocess.run(
        cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=AIPERF_TIMEOUT_S
    )
    out, url = (cmd[cmd.index(flag) + 1] for flag in ("--artifact-dir", "--url"))
    return AiperfRun(done.returncode, done.stdout + done.stderr, Path(out), url)


def check_exports(
    run: AiperfRun,
    stream: bool,
    server_tail: Callable[[], str] | None = None,
    bursts: bool = False,
) -> None:
    """The fixed workload's outcome, from aiperf's exports: it exited 0, all REQUESTS requests
    completed with none failed, each output OUTPUT_LEN tokens, and aiperf scraped
    `run.url`/metrics, kvserve's families among them. Streamed, each request's first token came
    before its last; with `bursts`, one may have come whole in one read (aiperf's TTFT = its
    latency), so long as some request did not. `server_tail()` (the server's last log lines)
    goes into the first failure's message."""
    export = run.out / "profile_export.jsonl"
    records = [json.loads(line) for line in export.open()] if export.exists() else []
    failed = [r["error"] for r in records if r.get("error")]
    assert run.returncode == 0 and not failed, (
        f"aiperf exited with {run.returncode}; failed requests: {failed[:3]}\n"
        f"{run.output[-4000:]}\nserver:\n{server_tail() if server_tail else ''}"
    )

    summary: dict[str, Any] = json.loads((run.out / "profile_export_aiperf.json").read_text())
    assert summary["is_complete"] and not summary["was_cancelled"]
    assert summary["error_summary"] == []
    assert summary["request_count"]["avg"] == REQUESTS
    assert summary["request_error_rate"]["avg"] == 0
    osl = summary["output_sequence_length"]
    assert (osl["count"], osl["min"], osl["max"]) == (REQUESTS, OUTPUT_LEN, OUTPUT_LEN), osl

    assert len(records) == REQUESTS
    streamed = 0
    for r in records:
        m = r["metrics"]
        assert m["output_sequence_length"]["value"] == OUTPUT_LEN, r
        assert m["usage_completion_tokens"]["value"] == OUTPUT_LEN, r
        if stream:  # the first token came before the last (or with it, in a burst)
            ttft, latency = m["time_to_first_token"]["value"], m["request_latency"]["value"]
            assert 0 < ttft < latency or (bursts and 0 < ttft == latency), r
            streamed += ttft < latency
    assert not stream or streamed, "every streamed request came in one read"

    scraped = json.loads((run.out / "server_metrics_export.json").read_text())
    assert scraped["summary"]["endpoints_successful"] == [run.url + "/metrics"], scraped["summary"]
    assert any(name.startswith("kvserve:") for name in scraped["metrics"])
