"""The servers `kvserve bench compare` and `scale` put side by side, each an `ArmServer`: a
`ServerProcess` and, for a stack without a given Redis, the redis-server it brings.

- kvserve itself (`kvserve serve`, ready at its `ready` log event; `kvserve-spec` with n-gram
  speculative decoding, `--speculative ngram --num-speculative-tokens K`; `kvserve-sync`
  without overlapped steps, `--no-async-scheduling`) and `kvserve stack`
  (`stack_server`: the topology its flags describe, e.g. the disaggregated arm's 2 prefill + 1
  decode workers), the stack on a redis-server started like compose.yaml's (maxmemory,
  allkeys-lru, no persistence) unless a Redis URL is given; ready once its gateway lists its
  workers.
- llama.cpp's `llama-server` (lib/llama_cpp.py), built on demand. The pinned version speculates
  only with a draft model (`-md`), so there is no n-gram arm of it.
- Hugging Face transformers behind the minimal OpenAI-compatible shim in lib/hf_shim.py.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from kvserve.services.bench.lib.llama_cpp import (
    SLOTS,
    ArmSetupError,
    ensure_llama_server,
    llama_server_cmd,
)
from kvserve.services.bench.lib.process import HttpReady, ServerProcess, kvserve_process
from kvserve.services.bench.lib.redis_server import RedisServer

ARMS = ("kvserve", "kvserve-fp32", "kvserve-bf16", "kvserve-disagg", "llama-server", "hf",
        "kvserve-spec", "kvserve-sync")  # fmt: skip
DEFAULT_ARMS = ARMS[:-2]  # `bench compare`'s default: kvserve-spec and -sync when asked for
SPECULATIVE_TOKENS = 4  # kvserve-spec's K by default
DISAGG_REDIS_MAXMEMORY = "2gb"  # compose.yaml's default
# The arms that are `kvserve serve` with flags of their own (kvserve-sync: steps not overlapped)
SERVE_FLAGS = {"kvserve": [], "kvserve-fp32": ["--weights", "fp32"],
               "kvserve-bf16": ["--weights", "bf16"],
               "kvserve-sync": ["--no-async-scheduling"]}  # fmt: skip


@dataclass(frozen=True)
class ArmSettings:
    """What every arm's server is given: the model file, where its logs go, the threads it may
    use, the stack's Redis (None: one of its own of `redis_maxmemory`) and kvserve's own request
    timeout (kvserve answers 504 to a request still unfinished after it; the other servers have
    no such limit: give the client's timeout)."""

    model: Path
    log_dir: Path
    threads: int = 2
    redis_url: str | None = None
    redis_maxmemory: str = DISAGG_REDIS_MAXMEMORY
    request_timeout: float = 3600.0
    speculative_tokens: int = SPECULATIVE_TOKENS  # kvserve-spec: tokens proposed per step

    @property
    def threads_env(self) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}


@dataclass
class ArmServer:
    """One arm's server, started in its own process group and stopped with the whole group;
    its own Redis, if it has one, is started before it and stopped after it."""

    process: ServerProcess
    redis: RedisServer | None = None

    @property
    def url(self) -> str:
        return self.process.url

    def start(self, timeout: float = 300.0) -> ArmServer:
        """Ready within `timeout` seconds; StartError (everything stopped) otherwise."""
        try:
            if self.redis is not None:
                self.redis.start()
            self.process.start(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, grace: float = 20.0) -> None:
        try:
            self.process.stop(grace)
        finally:
            if self.redis is not None:
                self.redis.stop()

    def __enter__(self) -> ArmServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def model_vocab(model: Path) -> int:
    """The vocabulary size the GGUF states: every arm is sent token ids below it."""
    from kvserve.shared.model.gguf_file import gguf_model_config, open_gguf

    return int(gguf_model_config(open_gguf(str(model))).vocab_size)


def _disagg_flags(threads: int) -> list[str]:
    """2 prefill and 1 decode worker, the arm's threads divided among them."""
    workers = {"--prefill": 2, "--decode": 1}
    flags = [str(x) for flag, n in workers.items() for x in (flag, n)]
    return [*flags, "--threads-per-worker", str(max(1, threads // sum(workers.values())))]


def stack_server(
    name: str, flags: list[str], port: int, settings: ArmSettings, workers: int = 0
) -> ArmServer:
    """`kvserve stack ... FLAGS` (the topology), not started, on the settings' Redis, or when
    that is None on a RedisServer of its own started and stopped with it; ready once its
    gateway lists `workers` live workers, whose KV caches are resident by then (as the serve
    arms')."""
    own = None
    if settings.redis_url is None:
        log = settings.log_dir / "redis.log"
        own = RedisServer(maxmemory=settings.redis_maxmemory, log=log)
    url = own.url if own is not None else str(settings.redis_url)
    args = ["--redis", url, "--model", str(settings.model), "--port", str(port), *flags]
    args += ["--request-timeout", str(settings.request_timeout), "--kv-populate", "eager"]
    process = kvserve_process(
        ["stack"], args, name=name, ready=HttpReady("/ready", workers),
        url=f"http://127.0.0.1:{port}", log=settings.log_dir / f"{name}.log",
        env=settings.threads_env,
    )  # fmt: skip
    return ArmServer(process, own)


def llama_server(port: int, settings: ArmSettings, slots: int = SLOTS) -> ArmServer:
    """llama-server with `slots` slots (`llama_server_cmd`), not started; builds it first if
    needed (ArmSetupError when that fails)."""
    cmd = llama_server_cmd(ensure_llama_server(), settings.model, port, settings.threads, slots)
    log = settings.log_dir / "llama-server.log"
    url = f"http://127.0.0.1:{port}"
    process = ServerProcess("llama-server", cmd, ready=HttpReady("/health"), url=url, log=log)
    return ArmServer(process)


def hf_server(port: int, settings: ArmSettings) -> ArmServer:
    """Transformers behind the shim, not started."""
    # -P: a checkout's top-level kernels/ folder, in the working directory, would shadow the
    # installed `kernels` package that transformers imports.
    cmd = [sys.executable, "-P", "-m", "kvserve.services.bench.lib.hf_shim"]
    cmd += ["--model", str(settings.model), "--port", str(port), "--threads", str(settings.threads)]
    process = ServerProcess(
        "hf", cmd, ready=HttpReady("/health"), url=f"http://127.0.0.1:{port}",
        log=settings.log_dir / "hf.log", env=settings.threads_env,
    )  # fmt: skip
    return ArmServer(process)


def serve_server(
    arm: str, port: int, settings: ArmSettings, flags: list[str] | None = None
) -> ArmServer:
    """`kvserve serve` on a memory store: the GGUF's own weights (`kvserve`), expanded to fp32
    (`kvserve-fp32`) or bf16 matmuls with everything else fp32 (`kvserve-bf16`); `flags` after
    the arm's own (kvserve-spec: `speculative_flags`). Its KV cache is resident before it is
    ready (`--kv-populate eager`): populated in the background, it slowed the first measured
    requests' decode 1.3-3x while it faulted in the cache's pages."""
    args = ["--model", str(settings.model), "--port", str(port), "--store", "memory://"]
    args += ["--request-timeout", str(settings.request_timeout), "--kv-populate", "eager"]
    args += [*SERVE_FLAGS.get(arm, []), *(flags or [])]
    log = settings.log_dir / f"{arm}.log"
    return ArmServer(kvserve_process(["serve"], args, name=arm, log=log, env=settings.threads_env))


def speculative_flags(k: int) -> list[str]:
    """kvserve-spec's flags: n-gram speculative decoding (vLLM's prompt lookup), `k` tokens
    proposed per step; ArmSetupError when this kvserve's `serve` does not take them."""
    if k < 1:
        raise ArmSetupError(f"kvserve-spec: the speculative tokens must be >= 1, got {k}")
    missing = [f for f in ("--speculative", "--num-speculative-tokens") if f not in serve_flags()]
    if missing:
        raise ArmSetupError(
            f"kvserve-spec: `kvserve serve` has no {' or '.join(missing)} option (n-gram "
            "speculative decoding is not in this version)"
        )
    return ["--speculative", "ngram", "--num-speculative-tokens", str(k)]


def serve_flags() -> set[str]:
    """Every option string `kvserve serve` takes (its parser built here; no engine loaded)."""
    from kvserve.services import serve

    sub = argparse.ArgumentParser().add_subparsers()
    serve.register(sub)
    return set(sub.choices["serve"]._option_string_actions)


def make_server(arm: str, port: int, settings: ArmSettings) -> ArmServer:
    """The arm's server, not started yet. Raises ArmSetupError when it cannot be set up (for
    llama-server: when the build fails; for kvserve-spec: when `kvserve serve` has no n-gram
    speculative decoding)."""
    if arm in SERVE_FLAGS:
        return serve_server(arm, port, settings)
    if arm == "kvserve-spec":
        return serve_server(arm, port, settings, speculative_flags(settings.speculative_tokens))
    if arm == "kvserve-disagg":
        return stack_server(arm, _disagg_flags(settings.threads), port, settings)
    if arm == "llama-server":
        return llama_server(port, settings)
    if arm == "hf":
        return hf_server(port, settings)
    raise ArmSetupError(f"unknown arm {arm!r}; arms: {', '.join(ARMS)}")
