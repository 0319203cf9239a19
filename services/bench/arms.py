"""The servers `kvserve bench compare` puts side by side with kvserve.

- llama.cpp's `llama-server`, built on demand into `cache_dir() / "llama.cpp"` from the llama.cpp
  sources vendored in PyPI's `llama-cpp-python` sdist (`ensure_llama_server`).
- Hugging Face transformers behind the minimal OpenAI-compatible shim in `hf_shim`.
- kvserve itself (`kvserve serve`) and `kvserve stack` (`stack_server`: the topology its flags
  describe, e.g. the disaggregated arm's 2 prefill + 1 decode workers), the stack on a
  redis-server the harness starts like compose.yaml's (`OwnRedis`: maxmemory, allkeys-lru, no
  persistence) unless a Redis URL is given.

Each arm is a command line plus a readiness URL; `ServerProcess` starts one, waits for it and stops
it (the whole process group, so the stack's children go too).

Differences the client has to know about llama-server: see `LLAMA_SERVER_NOTES`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvserve.kernels import cpp_build
from kvserve.shared import config

LLAMA_CPP_PYTHON_VERSION = "0.3.16"
# Bump to rebuild when the cmake flags change.
_BUILD_TYPE = "-DCMAKE_BUILD_TYPE=Release"
_BUILD_FLAGS = (
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DBUILD_SHARED_LIBS=OFF",
)
SLOTS = 8
CONTEXT_PER_SLOT = 2048


class ArmSetupError(RuntimeError):
    """An arm's server could not be built or started; the message says why."""


# llama.cpp's instruction sets for the kernels' -march (kernels/cpp_build.py, KVSERVE_CPU_ARCH),
# so that both servers run the same ones: this CPU's, or AVX2 with FMA alone (GGML_NATIVE off
# turns every other set off).
_ISA_FLAGS = {
    "native": ("-DGGML_NATIVE=ON",),
    "x86-64-v3": (
        "-DGGML_NATIVE=OFF",
        *(f"-DGGML_{isa}=ON" for isa in ("SSE42", "AVX", "AVX2", "FMA", "F16C", "BMI2")),
    ),
}


def _build_flags() -> tuple[str, ...]:
    arch = cpp_build.cpu_arch()
    if arch not in _ISA_FLAGS:
        choices = ", ".join(_ISA_FLAGS)
        raise ArmSetupError(f"llama-server: {cpp_build.ARCH_ENV}={arch!r} is not one of {choices}")
    return (_BUILD_TYPE, *_ISA_FLAGS[arch], *_BUILD_FLAGS)


def llama_cpp_dir() -> Path:
    """The build of llama.cpp for the kernels' -march (its own directory unless `native`)."""
    arch = cpp_build.cpu_arch()
    return config.cache_dir() / ("llama.cpp" if arch == "native" else f"llama.cpp-{arch}")


def _marker_text(version: str) -> str:
    return f"llama-cpp-python=={version}\n" + " ".join(_build_flags()) + "\n"


def llama_server_path() -> Path | None:
    """The cached llama-server binary if a finished build of the pinned version is there."""
    root = llama_cpp_dir()
    binary = root / "build" / "bin" / "llama-server"
    marker = root / "BUILT"
    if (
        binary.is_file()
        and marker.is_file()
        and marker.read_text() == _marker_text(LLAMA_CPP_PYTHON_VERSION)
    ):
        return binary
    return None


def _run(cmd: list[str], cwd: Path | None, log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = log.read_text().splitlines()[-25:]
        raise ArmSetupError(
            f"llama-server build step failed (exit {proc.returncode}): {' '.join(cmd)}\n"
            f"log: {log}\n" + "\n".join(tail)
        )


def _extract_vendored_llama_cpp(version: str, root: Path, log: Path) -> None:
    """Download the llama-cpp-python sdist of `version` (pip) and extract the llama.cpp it
    vendors into `root`."""
    with tempfile.TemporaryDirectory(prefix="llama-cpp-sdist-") as tmp:
        tmpdir = Path(tmp)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
        _run([*pip, "-d", str(tmpdir), f"llama-cpp-python=={version}"], None, log)
        sdists = list(tmpdir.glob("llama_cpp_python-*.tar.gz")) + list(
            tmpdir.glob("llama-cpp-python-*.tar.gz")
        )
        if not sdists:
            raise ArmSetupError(f"pip download left no llama-cpp-python sdist in {tmpdir}")
        with tarfile.open(sdists[0]) as tar:
            prefix = tar.getnames()[0].split("/")[0] + "/vendor/llama.cpp/"
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            if not members:
                raise ArmSetupError(f"{sdists[0].name} has no vendor/llama.cpp")
            for m in members:
                m.name = m.name[len(prefix) :]
            tar.extractall(root, members=[m for m in members if m.name], filter="data")


def ensure_llama_server(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int = 2) -> Path:
    """Path of a llama-server binary, building it into `llama_cpp_dir()` if not there yet.

    Downloads the llama-cpp-python sdist with pip, extracts its vendored llama.cpp and builds the
    `llama-server` target with cmake; a marker file naming the version and flags makes a second
    call a no-op. Raises ArmSetupError with the failing step and the log's tail.
    """
    flags = _build_flags()
    if version == LLAMA_CPP_PYTHON_VERSION and (found := llama_server_path()) is not None:
        return found
    root = llama_cpp_dir()
    binary = root / "build" / "bin" / "llama-server"
    marker = root / "BUILT"
    if binary.is_file() and marker.is_file() and marker.read_text() == _marker_text(version):
        return binary
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise ArmSetupError(f"cannot build llama-server: {tool!r} is not on PATH")
    root.parent.mkdir(parents=True, exist_ok=True)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir()
    log = root / "build.log"
    started = time.monotonic()
    _extract_vendored_llama_cpp(version, root, log)
    _run(["cmake", "-B", "build", *flags], root, log)
    _run(["cmake", "--build", "build", "--target", "llama-server", "-j", str(jobs)], root, log)
    if not binary.is_file():
        raise ArmSetupError(f"the build finished without {binary}; log: {log}")
    elapsed = time.monotonic() - started
    with log.open("a") as out:
        out.write(f"built in {elapsed:.0f} s\n")
    marker.write_text(_marker_text(version))
    return binary


# ---- running an arm's server --------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


@dataclass
class OwnRedis:
    """A throwaway redis-server for the disaggregated arm, configured as compose.yaml's: at
    `maxmemory` it evicts the least recently used keys (the prefix store is a cache), it keeps
    nothing on disk. The stack's blocks then cannot fill the machine, nor touch a shared Redis."""

    port: int
    maxmemory: str
    log: Path
    proc: subprocess.Popen[bytes] | None = None
    workdir: Path | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        import redis

        binary = shutil.which("redis-server")
        if binary is None:
            raise ArmSetupError("kvserve-disagg: redis-server is not on PATH (or pass --redis URL)")
        self.workdir = Path(tempfile.mkdtemp(prefix="kvserve-bench-redis-"))
        cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1"]
        cmd += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        cmd += ["--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)
        deadline = time.monotonic() + timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    self.stop()
                    raise ArmSetupError(
                        f"redis-server exited with {self.proc.returncode}; log {self.log}:\n"
                        + _tail(self.log)
                    )
                try:
                    if client.ping():
                        return
                except redis.RedisError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise ArmSetupError(f"redis-server not answering on port {self.port}")
                time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.workdir is not None:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self.workdir = None


def gateway_stats(base_url: str) -> dict[str, Any]:
    """A kvserve gateway's GET /v1/cache/stats; {} when it does not answer with a JSON object."""
    try:
        with urllib.request.urlopen(base_url + "/v1/cache/stats", timeout=10) as resp:
            stats = json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError):
        return {}
    return stats if isinstance(stats, dict) else {}


def server_ready(base_url: str, ready_url: str, workers: int = 0) -> bool:
    """Does `ready_url` answer 200 and, for a kvserve gateway given `workers`, does it list at
    least that many live workers?"""
    try:
        with urllib.request.urlopen(ready_url, timeout=5) as resp:
            if resp.status != 200:
                return False
    except (urllib.error.URLError, OSError):
        return False  # not listening yet, or 503 while loading
    live = gateway_stats(base_url).get("workers") if workers else None
    return not workers or len(live or {}) >= workers


@dataclass
class ServerProcess:
    """One arm's server: started in its own process group, stopped with the whole group (and
    after it, the arm's own Redis if it has one). Ready when `ready_path` answers 200 and, for a
    kvserve gateway given `workers`, once it lists that many live workers (its /ready needs
    one)."""

    name: str
    cmd: list[str]
    port: int
    ready_path: str
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None
    redis: OwnRedis | None = None
    workers: int = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 300.0) -> None:
        if self.redis is not None:
            self.redis.start()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            out.write(f"$ {' '.join(self.cmd)}\n".encode())
            out.flush()
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        url = self.base_url + self.ready_path
        while True:
            if self.proc.poll() is not None:
                raise ArmSetupError(
                    f"{self.name}: the server exited with {self.proc.returncode} before it was "
                    f"ready; log {self.log}:\n{_tail(self.log)}"
                )
            if self._ready(url):
                return
            if time.monotonic() > deadline:
                raise ArmSetupError(
                    f"{self.name}: not ready at {url} after {timeout:.0f} s; log {self.log}:\n"
                    + _tail(self.log)
                )
            time.sleep(0.5)

    def _ready(self, url: str) -> bool:
        return server_ready(self.base_url, url, self.workers)

    def stop(self, grace: float = 20.0) -> None:
        try:
            self._stop_group(grace)
        finally:
            if self.redis is not None:
                self.redis.stop()

    def _stop_group(self, grace: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        except ProcessLookupError:
            pass

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


LLAMA_SERVER_NOTES = """\
llama-server (llama.cpp vendored in llama-cpp-python 0.3.16), observed on /v1/completions:
- `prompt` as a list of token ids is taken as is (no BOS added: BOS is only inserted for string
  prompts); a list of lists is a batch of prompts (choices with index 0, 1, ...).
- `ignore_eos`, `temperature: 0` and `max_tokens` work; greedy tokens match transformers' (the
  HF shim's) on the default GGUF.
- Streaming: one chunk per token with `text`, no token ids; then a final chunk with empty `text`,
  `finish_reason` and `usage` (and llama.cpp's `timings`) in the same chunk - no separate
  `choices: []` usage chunk; `stream_options` is accepted and not needed.
- `usage` has no `prompt_tokens_details.cached_tokens`; the prompt-cache hit is
  `usage.prompt_tokens - timings.prompt_n` (prompt tokens actually evaluated).
- Chunks say `model: "gpt-3.5-turbo"` and `id: "chatcmpl-..."` whatever was asked; /v1/models
  lists the GGUF path as the id and gives the vocabulary as `meta.n_vocab`, not `vocab_size`.
- `cache_prompt` is on by default per request (each slot reuses its previous prompt's prefix);
  `--cont-batching` is the default; `-c` is the total context, split evenly across slots.
"""


def llama_server_cmd(
    binary: Path, model: Path, port: int, threads: int = 2, slots: int = SLOTS
) -> list[str]:
    """Continuous batching over `slots` slots of CONTEXT_PER_SLOT tokens each (`-c` is the total,
    split evenly across slots); the prompt cache (`cache_prompt`, on by default per request)
    reuses each slot's previous prompt."""
    return [
        str(binary),
        "-m", str(model),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--parallel", str(slots),
        "--cont-batching",
        "-c", str(slots * CONTEXT_PER_SLOT),
        "--threads", str(threads),
        "--threads-batch", str(threads),
        "--no-webui",
    ]  # fmt: skip


def _kvserve_exe() -> str:
    beside = Path(sys.executable).parent / "kvserve"
    return str(beside) if beside.exists() else (shutil.which("kvserve") or "kvserve")


ARMS = ("kvserve", "kvserve-fp32", "kvserve-bf16", "kvserve-disagg", "llama-server", "hf")
DISAGG_REDIS_MAXMEMORY = "2gb"  # compose.yaml's default


def _threads_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def _disagg_flags(threads: int) -> list[str]:
    """2 prefill and 1 decode worker, the arm's threads divided among them."""
    workers = {"--prefill": 2, "--decode": 1}
    flags = [str(x) for flag, n in workers.items() for x in (flag, n)]
    return [*flags, "--threads-per-worker", str(max(1, threads // sum(workers.values())))]


def stack_server(
    name: str,
    flags: list[str],
    model: Path,
    port: int,
    log_dir: Path,
    threads: int = 2,
    redis_url: str | None = None,
    redis_maxmemory: str = DISAGG_REDIS_MAXMEMORY,
    request_timeout: float = 3600.0,
    workers: int = 0,
) -> ServerProcess:
    """`kvserve stack ... FLAGS` (the topology), not started, on `redis_url`, or when that is
    None on an `OwnRedis` of `redis_maxmemory` started and stopped with it; ready once its
    gateway lists `workers` live workers."""
    own = None if redis_url else OwnRedis(free_port(), redis_maxmemory, log_dir / "redis.log")
    url = own.url if own is not None else str(redis_url)
    cmd = [_kvserve_exe(), "stack", "--redis", url, "--model", str(model), "--port", str(port)]
    cmd += [*flags, "--request-timeout", str(request_timeout)]
    log = log_dir / f"{name}.log"
    env = _threads_env(threads)
    return ServerProcess(name, cmd, port, "/ready", log, env, redis=own, workers=workers)


def llama_server(
    model: Path, port: int, log_dir: Path, threads: int = 2, slots: int = SLOTS
) -> ServerProcess:
    """llama-server with `slots` slots (`llama_server_cmd`), not started; builds it first if
    needed (ArmSetupError when that fails)."""
    cmd = llama_server_cmd(ensure_llama_server(), model, port, threads, slots)
    return ServerProcess("llama-server", cmd, port, "/health", log_dir / "llama-server.log")


def make_server(
    arm: str,
    model: Path,
    port: int,
    log_dir: Path,
    threads: int = 2,
    redis_url: str | None = None,
    redis_maxmemory: str = DISAGG_REDIS_MAXMEMORY,
    request_timeout: float = 3600.0,
) -> ServerProcess:
    """The arm's server, not started yet. Raises ArmSetupError when it cannot be set up (for
    llama-server: when the build fails). kvserve-disagg runs on `redis_url`, or when that is None
    on an `OwnRedis` of `redis_maxmemory` started with it. kvserve's arms answer 504 to a request
    still unfinished after `request_timeout` seconds (the other servers have no such limit: give
    the client's timeout)."""
    timeout = ["--request-timeout", str(request_timeout)]
    threads_env = _threads_env(threads)
    log = log_dir / f"{arm}.log"
    if arm in ("kvserve", "kvserve-fp32", "kvserve-bf16"):
        cmd = [_kvserve_exe(), "serve", "--model", str(model), "--port", str(port)]
        cmd += ["--store", "memory://", *timeout]
        if arm == "kvserve-fp32":  # the file's weights expanded to fp32
            cmd += ["--weights", "fp32"]
        if arm == "kvserve-bf16":  # bf16 matmuls, everything else (KV cache included) fp32
            cmd += ["--weights", "bf16"]
        return ServerProcess(arm, cmd, port, "/ready", log, threads_env)
    if arm == "kvserve-disagg":
        flags = _disagg_flags(threads)
        return stack_server(
            arm, flags, model, port, log_dir, threads, redis_url, redis_maxmemory, request_timeout
        )
    if arm == "llama-server":
        return llama_server(model, port, log_dir, threads)
    if arm == "hf":
        cmd = [sys.executable, "-m", "kvserve.services.bench.hf_shim", "--model", str(model)]
        cmd += ["--port", str(port), "--threads", str(threads)]
        return ServerProcess(arm, cmd, port, "/health", log, threads_env)
    raise ArmSetupError(f"unknown arm {arm!r}; arms: {', '.join(ARMS)}")
