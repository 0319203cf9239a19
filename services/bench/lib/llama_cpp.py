"""llama.cpp's `llama-server`, the arm `kvserve bench compare` and `scale` put beside kvserve:
built on demand into `cache_dir() / "llama.cpp"` from the llama.cpp sources vendored in PyPI's
`llama-cpp-python` sdist (`ensure_llama_server`), run as `llama_server_cmd` says.

Differences the client has to know about llama-server: see `LLAMA_SERVER_NOTES`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from kvserve.kernels import cpp_build
from kvserve.services.bench.lib.process import StartError
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


class ArmSetupError(StartError):
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


def _built(version: str) -> Path | None:
    """The binary of a finished build of `version` with today's flags, else None."""
    root = llama_cpp_dir()
    binary = root / "build" / "bin" / "llama-server"
    marker = root / "BUILT"
    if binary.is_file() and marker.is_file() and marker.read_text() == _marker_text(version):
        return binary
    return None


def llama_server_path() -> Path | None:
    """The cached llama-server binary if a finished build of the pinned version is there."""
    return _built(LLAMA_CPP_PYTHON_VERSION)


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
    if (found := _built(version)) is not None:
        return found
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise ArmSetupError(f"cannot build llama-server: {tool!r} is not on PATH")
    root = llama_cpp_dir()
    binary = root / "build" / "bin" / "llama-server"
    _fresh_dir(root)
    log = root / "build.log"
    started = time.monotonic()
    _extract_vendored_llama_cpp(version, root, log)
    _run(["cmake", "-B", "build", *flags], root, log)
    _run(["cmake", "--build", "build", "--target", "llama-server", "-j", str(jobs)], root, log)
    if not binary.is_file():
        raise ArmSetupError(f"the build finished without {binary}; log: {log}")
    with log.open("a") as out:
        out.write(f"built in {time.monotonic() - started:.0f} s\n")
    (root / "BUILT").write_text(_marker_text(version))
    return binary


def _fresh_dir(root: Path) -> None:
    root.parent.mkdir(parents=True, exist_ok=True)
    if root.exists():
        shutil.rmtree(root)
    root.mkdir()


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
