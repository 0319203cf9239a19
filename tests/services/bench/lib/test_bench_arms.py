"""The comparison arms beside kvserve, over real HTTP with the real model: the Hugging Face shim's
greedy stream equals the engine's tokens; llama-server (when already built into the cache dir)
streams a token-id completion of exactly max_tokens tokens with usage; the kvserve-spec arm's
command line, and its setup error where `kvserve serve` has no n-gram speculative decoding."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from kvserve.kernels import cpp_build
from kvserve.services.bench.lib import arms, llama_cpp
from kvserve.services.bench.lib.arms import ArmSettings, make_server
from kvserve.services.bench.lib.llama_cpp import (
    ArmSetupError,
    ensure_llama_server,
    llama_cpp_dir,
    llama_server_path,
)
from kvserve.services.bench.lib.process import free_port
from kvserve.shared.sampling_params import SamplingParams

MAX_TOKENS = 8


async def stream_completion(base_url: str, prompt: list[int]) -> list[dict[str, Any]]:
    """The parsed `data:` chunks of one streaming token-id completion, up to `[DONE]`."""
    body = {
        "model": "any",
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=300)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.post(base_url + "/v1/completions", json=body) as resp,
    ):
        assert resp.status == 200, await resp.text()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                return chunks
            chunks.append(json.loads(data))
    raise AssertionError("the stream ended without data: [DONE]")


def final_usage(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    usages = [c["usage"] for c in chunks if c.get("usage")]
    assert usages, "no usage in the stream"
    usage: dict[str, Any] = usages[-1]
    return usage


@pytest.mark.slow  # loading the GGUF into transformers takes about a minute on 2 busy cores
def test_hf_shim_streams_the_engines_greedy_tokens(
    model_path: Path, make_engine: Any, chat_prompt_ids: list[list[int]], tmp_path: Path
) -> None:
    prompt = chat_prompt_ids[0]
    server = make_server("hf", free_port(), ArmSettings(model_path, tmp_path, threads=2))
    with server:
        chunks = asyncio.run(stream_completion(server.url, prompt))
    engine = make_engine(num_blocks=64)
    expected = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
    got = [t for c in chunks for choice in c["choices"] for t in choice["token_ids"]]
    assert got == expected[0][0]
    token_chunks = [c for c in chunks if c["choices"]]
    assert len(token_chunks) == MAX_TOKENS  # one chunk per token, as it is made
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    usage = final_usage(chunks)
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["completion_tokens"] == MAX_TOKENS


def built_llama_server() -> Path:
    found = llama_server_path()
    if found is None:
        pytest.skip(
            f"llama-server is not built in {llama_cpp_dir()}; build it with `python -c 'from "
            "kvserve.services.bench.lib.llama_cpp import ensure_llama_server; "
            "ensure_llama_server()'` (minutes)"
        )
    return found


def test_ensure_llama_server_reuses_the_cached_build(monkeypatch: pytest.MonkeyPatch) -> None:
    binary = built_llama_server()
    before = binary.stat().st_mtime_ns

    def no_build(*args: object) -> None:
        raise AssertionError(f"the cached build was not reused: {args}")

    monkeypatch.setattr(llama_cpp, "_extract_vendored_llama_cpp", no_build)
    monkeypatch.setattr(llama_cpp, "_run", no_build)
    assert ensure_llama_server() == binary
    assert binary.stat().st_mtime_ns == before


def test_llama_server_streams_a_token_id_completion(
    model_path: Path, chat_prompt_ids: list[list[int]], tmp_path: Path
) -> None:
    built_llama_server()
    prompt = chat_prompt_ids[0]
    server = make_server("llama-server", free_port(), ArmSettings(model_path, tmp_path, threads=2))
    with server:
        chunks = asyncio.run(stream_completion(server.url, prompt))
    usage = final_usage(chunks)
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["completion_tokens"] == MAX_TOKENS
    text_chunks = [c for c in chunks if c["choices"] and c["choices"][0].get("text")]
    assert 0 < len(text_chunks) <= MAX_TOKENS


@pytest.mark.slow  # ~4-5 s: a Redis server of its own, started and stopped (2-core AVX2 machine)
@pytest.mark.redis
def test_disagg_arm_brings_a_bounded_redis_and_takes_it_down(
    model_path: Path, tmp_path: Path
) -> None:
    import redis

    settings = ArmSettings(model_path, tmp_path, redis_maxmemory="64mb")
    server = make_server("kvserve-disagg", free_port(), settings)
    own = server.redis
    assert own is not None
    cmd = server.process.cmd
    assert cmd[cmd.index("--redis") + 1] == own.url
    own.start()
    client = redis.Redis(port=own.port)
    try:
        assert client.config_get("maxmemory")["maxmemory"] == str(64 << 20)
        assert client.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
        assert client.config_get("save")["save"] == ""
        workdir = own.workdir
        assert workdir is not None and workdir.is_dir()
    finally:
        server.stop()  # the stack never started: stopping it still takes its Redis down
    assert own.proc is not None and own.proc.returncode is not None
    assert not workdir.exists()
    with pytest.raises(redis.ConnectionError):
        client.ping()


def test_disagg_arm_on_a_given_redis_starts_none(model_path: Path, tmp_path: Path) -> None:
    url = "redis://127.0.0.1:6379/14"
    server = make_server("kvserve-disagg", free_port(), ArmSettings(model_path, tmp_path, 2, url))
    assert server.redis is None
    cmd = server.process.cmd
    assert cmd[cmd.index("--redis") + 1] == url


@pytest.mark.parametrize("arm", ["kvserve", "kvserve-bf16", "kvserve-disagg"])
def test_kvserve_arms_take_the_clients_timeout(arm: str, model_path: Path, tmp_path: Path) -> None:
    """The server's own request timeout (600 s by default) must not cut a long trace replay
    short: the other servers have none."""
    server = make_server(arm, free_port(), ArmSettings(model_path, tmp_path, request_timeout=3660))
    cmd = server.process.cmd
    assert cmd[cmd.index("--request-timeout") + 1] == "3660"


@pytest.mark.parametrize("arm", ["kvserve", "kvserve-fp32", "kvserve-bf16", "kvserve-disagg"])
def test_kvserve_arms_populate_their_kv_cache_before_they_are_ready(
    arm: str, model_path: Path, tmp_path: Path
) -> None:
    """A cache populated in the background while the first requests run slows their decode:
    a benchmark measures the server once its cache is resident."""
    cmd = make_server(arm, free_port(), ArmSettings(model_path, tmp_path)).process.cmd
    assert cmd[cmd.index("--kv-populate") + 1] == "eager"


def test_llama_server_is_built_for_the_kernels_march(monkeypatch: pytest.MonkeyPatch) -> None:
    native_dir = llama_cpp_dir()
    assert "-DGGML_NATIVE=ON" in llama_cpp._build_flags()
    monkeypatch.setenv(cpp_build.ARCH_ENV, "x86-64-v3")
    flags = llama_cpp._build_flags()
    assert {"-DGGML_AVX2=ON", "-DGGML_FMA=ON"} <= set(flags)
    assert "-DGGML_NATIVE=OFF" in flags
    assert not any("AVX512" in f for f in flags)
    assert llama_cpp_dir() != native_dir  # its own build beside the native one
    monkeypatch.setenv(cpp_build.ARCH_ENV, "armv9-a")
    with pytest.raises(ArmSetupError, match="armv9-a"):
        ensure_llama_server()


SPEC_FLAGS = {"--speculative", "--num-speculative-tokens"}


def test_spec_arm_runs_kvserve_serve_with_ngram_speculation(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(arms, "serve_flags", lambda: {"--model", *SPEC_FLAGS})
    settings = ArmSettings(tmp_path / "m.gguf", tmp_path, speculative_tokens=6)
    cmd = make_server("kvserve-spec", 8123, settings).process.cmd
    assert cmd[cmd.index("serve") + 1 :][:2] == ["--model", str(tmp_path / "m.gguf")]
    assert cmd[cmd.index("--store") + 1] == "memory://"
    assert cmd[cmd.index("--speculative") :] == [
        "--speculative", "ngram", "--num-speculative-tokens", "6",
    ]  # fmt: skip
    assert "--weights" not in cmd  # the file's own blocks, as the kvserve arm
    plain = make_server("kvserve", 8123, settings).process.cmd
    assert plain == cmd[: cmd.index("--speculative")]


def test_spec_arm_without_the_engines_flags_is_an_arm_setup_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(arms, "serve_flags", lambda: {"--model", "--store"})
    with pytest.raises(ArmSetupError, match="kvserve-spec: `kvserve serve` has no --speculative"):
        make_server("kvserve-spec", 8123, ArmSettings(tmp_path / "m.gguf", tmp_path))
    monkeypatch.setattr(arms, "serve_flags", lambda: SPEC_FLAGS)
    with pytest.raises(ArmSetupError, match=">= 1"):
        make_server("kvserve-spec", 8123, ArmSettings(tmp_path, tmp_path, speculative_tokens=0))


def test_sync_arm_is_kvserve_serve_without_overlapped_steps(tmp_path: Path) -> None:
    settings = ArmSettings(tmp_path / "m.gguf", tmp_path)
    cmd = make_server("kvserve-sync", 8123, settings).process.cmd
    assert cmd == [*make_server("kvserve", 8123, settings).process.cmd, "--no-async-scheduling"]
    assert "--no-async-scheduling" in arms.serve_flags()
    assert "kvserve-sync" in arms.ARMS and "kvserve-sync" not in arms.DEFAULT_ARMS


def test_serve_flags_are_read_from_kvserve_serves_parser() -> None:
    flags = arms.serve_flags()
    assert {"--model", "--store", "--port", "--weights"} <= flags
    assert "kvserve-spec" in arms.ARMS and "kvserve-spec" not in arms.DEFAULT_ARMS
