"""NVIDIA's aiperf benchmark client against `kvserve serve`, unchanged (the fixed workload, how
aiperf is installed and what its exports must show: tests/services/aiperf_run.py), per endpoint:
chat streamed, completions not, behind an API key. Asserted from aiperf's own exports: 16
requests, none failed, every output 16 tokens, aiperf read kvserve's /metrics; and from the
server's log: the prefix-cache reset (`--reset-kv-cache`, POST /reset_prefix_cache) reached it."""

from __future__ import annotations

from pathlib import Path

import pytest
from kvserve.services.bench.lib.http import Http
from kvserve.services.bench.lib.process import ServerProcess
from kvserve.services.bench.lib.readiness import poll_until

from tests.services.aiperf_run import (
    aiperf_command,
    check_exports,
    export_hf_tokenizer,
    install_aiperf,
    run_aiperf,
)
from tests.services.server_state import idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]  # the first run installs aiperf

MODEL = "kvtest-aiperf"
KEY = "aiperf-key"


@pytest.fixture(scope="module")
def aiperf() -> Path:
    return install_aiperf()


@pytest.fixture(scope="module")
def hf_tokenizer(model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_hf_tokenizer(model_path, tmp_path_factory.mktemp("hf-tokenizer"))


@pytest.fixture(scope="module")
def server(start_server) -> ServerProcess:
    return start_server(
        "--store", "memory://", "--served-model-name", MODEL, "--num-blocks", "256",
        "--api-key", KEY,
    )  # fmt: skip


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
    cmd = aiperf_command(
        aiperf, server.url, MODEL, hf_tokenizer, endpoint, stream, tmp_path / "aiperf", KEY
    )
    run = run_aiperf(cmd, cwd=tmp_path)
    check_exports(run, stream, lambda: server.tail(30))
    assert flushes(server) > flushed_before  # --reset-kv-cache reached /reset_prefix_cache
