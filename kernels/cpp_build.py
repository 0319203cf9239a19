"""Build the C++ CPU kernels (kernels/csrc/) once per machine, and load them.

The kernels compile with -march=native (or -march=$KVSERVE_CPU_ARCH: x86-64-v3 builds the AVX2
code on a machine that has more, for a portable library or to measure that code) into one library,
`<cache dir>/kernels/<name>_<key>.so`, whose key hashes everything that changes the binary: the
sources, the compiler flags, this CPU's feature flags (for -march=native), torch's and Python's
versions. A process loads the library it finds there and runs the compiler only when there is
none (set-up builds it ahead: `python -m kvserve.kernels.cpp_build`).
Another CPU, a changed kernel or another torch gets another key, hence a build of its own.

Building never blocks for good and never leaves half a library behind:
- one builder at a time per directory, under an `fcntl.flock` lock, which the kernel releases
  when its holder dies, however it dies;
- the compiler writes into a private temporary directory, and the finished library is renamed
  into place (atomic within a file system): a reader finds a whole library or none;
- a process that finds the lock held waits at most KVSERVE_KERNEL_WAIT_S seconds (default 300),
  saying so in one line, then runs on torch's ops.
Each library ends in a trailer (after the ELF image, which the dynamic loader ignores) holding its
key and the SHA-256 of the bytes before it. A library whose trailer does not verify (truncated,
damaged, not a library, built for another CPU or from other sources) is never handed to the
dynamic loader (a truncated library kills a process with SIGBUS there): it is reported in one
line, removed, and built again. Where no build succeeds (no compiler), the callers use torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.util
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
ARCH_ENV = "KVSERVE_CPU_ARCH"
CFLAGS = ("-O3", "-ffast-math", "-fopenmp", "-fPIC", "-std=c++20")
LDFLAGS = ("-fopenmp",)
# Bump when the way a library is built or laid out changes (part of every key).
LAYOUT = "1"
TRAILER_MAGIC = b"KVSRVLIB"
TRAILER_LEN = len(TRAILER_MAGIC) + 16 + 32  # magic, key (16 hex digits), sha256
WAIT_ENV = "KVSERVE_KERNEL_WAIT_S"
DEFAULT_WAIT_S = 300.0


class BadLibrary(Exception):
    """A library file that must not be loaded."""


@dataclass(frozen=True)
class Recipe:
    """A Python extension module compiled from `main` (which includes the other `sources`).
    `torch`: compiled and linked against torch (pybind11 bindings of torch tensors)."""

    name: str
    main: Path
    sources: tuple[Path, ...]
    cflags: tuple[str, ...] = ("-march=native", *CFLAGS)
    torch: bool = True
    ldflags: tuple[str, ...] = LDFLAGS

    @functools.cached_property
    def key(self) -> str:
        h = hashlib.sha256()
        # A named -march builds the same library on any CPU: only `native` depends on this one.
        cpu = _cpu_flags() if "-march=native" in self.cflags else ""
        parts = [LAYOUT, platform.machine(), cpu, sys.implementation.cache_tag]
        if self.torch:
            import torch

            parts += [torch.__version__, str(torch.version.git_version)]
        for part in [*parts, *self.cflags, "|", *self.ldflags]:
            h.update(part.encode() + b"\0")
        for path in sorted({self.main, *self.sources}):
            h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
        return h.hexdigest()[:16]

    @property
    def module_name(self) -> str:
        return f"{self.name}_{self.key}"

    def commands(self, output: Path) -> list[list[str]]:
        """The compiler calls that build the library at `output` (without its trailer): compile,
        then link. Apart, so that -ffast-math stays out of the link: linked with it, GCC adds
        crtfastmath.o, whose constructor sets flush-to-zero for the whole process on load."""
        cxx = os.environ.get("CXX", "c++")
        includes = [sysconfig.get_path("include", scheme="posix_prefix")]
        libs: list[str] = []
        defines = [f"-DKVSERVE_MODULE={self.module_name}"]
        if self.torch:
            from torch.utils.cpp_extension import include_paths, library_paths

            includes += include_paths("cpu")
            (lib,) = library_paths("cpu")
            defines += [
                f"-DTORCH_EXTENSION_NAME={self.module_name}",
                "-DTORCH_API_INCLUDE_EXTENSION_H",
            ]
            libs = [f"-L{lib}", f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu", "-ltorch"]
            libs.append("-ltorch_python")
        isystem = [arg for inc in includes for arg in ("-isystem", inc)]
        obj = str(output.with_suffix(".o"))
        compile_ = [cxx, *defines, *isystem, *self.cflags, "-c", str(self.main), "-o", obj]
        link = [cxx, "-shared", *self.ldflags, obj, "-o", str(output), *libs]
        return [compile_, link]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def kernels_recipe() -> Recipe:
    """The kvserve CPU kernels: csrc/module.cpp and the headers it includes (csrc/third_party:
    xxHash's, for the store frames' checksum)."""
    flags = (f"-march={cpu_arch()}", *CFLAGS)
    return Recipe("kvserve_kernels", CSRC / "module.cpp", tuple(sorted(CSRC.rglob("*.h"))), flags)


def cpu_arch() -> str:
    """The -march the kernels are built for: $KVSERVE_CPU_ARCH, or this CPU's (`native`)."""
    return os.environ.get(ARCH_ENV, "").strip() or "native"


def kernel_dir() -> Path:
    """`kernels/` under kvserve's cache directory (the rule of shared.config.cache_dir, which
    this layer cannot import)."""
    if root := os.environ.get("KVSERVE_CACHE_DIR"):
        return Path(root) / "kernels"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvserve" / "kernels"


@functools.cache
def extension() -> ModuleType | None:
    """The compiled CPU kernels (loaded, built first where absent), or None: use torch."""
    return load_or_build(kernels_recipe(), kernel_dir())


# ---- load --------------------------------------------------------------------------------------


def library_path(recipe: Recipe, directory: Path) -> Path:
    return directory / f"{recipe.module_name}.so"


def _trailer(key: str, image: bytes) -> bytes:
    return TRAILER_MAGIC + key.encode() + hashlib.sha256(image + key.encode()).digest()


def verify(path: Path, key: str) -> None:
    """Raise BadLibrary unless `path` is a whole library that was built for `key`."""
    data = path.read_bytes()
    image, trailer = data[:-TRAILER_LEN], data[-TRAILER_LEN:]
    if len(data) <= TRAILER_LEN or not trailer.startswith(TRAILER_MAGIC):
        raise BadLibrary("not a kvserve kernel library, or cut short")
    if trailer[len(TRAILER_MAGIC) : len(TRAILER_MAGIC) + 16] != key.encode():
        raise BadLibrary("built for another CPU, torch or source")
    if trailer != _trailer(key, image):
        raise BadLibrary("damaged (checksum mismatch)")


def _import(recipe: Recipe, path: Path) -> ModuleType:
    verify(path, recipe.key)
    spec = importlib.util.spec_from_file_location(recipe.module_name, path)
    assert spec is not None and spec.loader is not None
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (ImportError, OSError) as e:
        raise BadLibrary(f"cannot be loaded: {e}") from e
    return module


def load_or_build(
    recipe: Recipe, directory: Path, wait_s: float | None = None
) -> ModuleType | None:
    """The module of `recipe` from `directory`, built there first where it is absent or bad;
    None where it cannot be built (logged once) or another builder holds the lock past
    `wait_s` (default: KVSERVE_KERNEL_WAIT_S, else 300 s)."""
    path = library_path(recipe, directory)
    if path.exists():
        try:
            return _import(recipe, path)
        except BadLibrary as e:
            log.warning("kvserve: CPU kernel library %s %s; building it again", path, e)
    if wait_s is None:
        wait_s = float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with _build_lock(directory, wait_s) as locked:
            if not locked:
                log.warning(
                    "kvserve: gave up after %.0f s waiting for the CPU kernels' build; "
                    "using torch's ops",
                    wait_s,
                )
                return None
            return _load_or_build_locked(recipe, directory, path)
    except OSError as e:
        log.warning("kvserve: cannot build the CPU kernels in %s (%s); using torch", directory, e)
        return None


def _load_or_build_locked(recipe: Recipe, directory: Path, path: Path) -> ModuleType | None:
    if path.exists():  # built by the holder this process waited for (or still the bad one)
        try:
            return _import(recipe, path)
        except BadLibrary:
            path.unlink()
    if not _compile(recipe, directory, path):
        return None
    try:
        return _import(recipe, path)
    except BadLibrary as e:
        log.warning("kvserve: the CPU kernels just built %s; using torch's ops", e)
        return None


# ---- build -------------------------------------------------------------------------------------


@contextlib.contextmanager
def _build_lock(directory: Path, wait_s: float) -> Iterator[bool]:
    """Hold the directory's build lock (True), or give up after `wait_s` (False). The lock is an
    flock, so a builder that dies, however, releases it."""
    with open(directory / "build.lock", "a+") as f:
        deadline = time.monotonic() + wait_s
        waiting = False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if not waiting:
                    f.seek(0)
                    holder = f.read().strip() or "another process"
                    print(
                        f"kvserve: waiting up to {wait_s:.0f} s for the CPU kernels that "
                        f"{holder} is building",
                        file=sys.stderr,
                        flush=True,
                    )
                    waiting = True
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.1)
        try:
            f.seek(0)
            f.truncate()
            f.write(f"pid {os.getpid()}")
            f.flush()
            _remove_stale_builds(directory)
            yield True
        finally:
            f.truncate(0)
            fcntl.flock(f, fcntl.LOCK_UN)


def _remove_stale_builds(directory: Path) -> None:
    """Temporary directories of builders that died (only the lock holder builds)."""
    for stale in directory.glob("build-*"):
        shutil.rmtree(stale, ignore_errors=True)


def _compile(recipe: Recipe, directory: Path, path: Path) -> bool:
    """Compile into a temporary directory, add the trailer, rename into place; False (logged)
    where the compiler is missing or fails."""
    t0 = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="build-", dir=directory))
    try:
        out = tmp / path.name
        commands = recipe.commands(out)
        if shutil.which(commands[0][0]) is None:
            log.warning(
                "kvserve: no C++ compiler (%s) for the CPU kernels; using torch", commands[0][0]
            )
            return False
        print(
            f"kvserve: building the CPU kernels for this machine into {directory} "
            "(once; under a minute on 2 cores)",
            file=sys.stderr,
            flush=True,
        )
        for command in commands:
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                (directory / f"{recipe.module_name}.log").write_text(done.stderr)
                last = (done.stderr.strip().splitlines() or ["no output"])[-1]
                log.warning(
                    "kvserve: the CPU kernels did not compile (%s; log in %s); using torch",
                    last[:200],
                    directory / f"{recipe.module_name}.log",
                )
                return False
        image = out.read_bytes()
        out.write_bytes(image + _trailer(recipe.key, image))
        os.replace(out, path)
        _record_build(directory, recipe, time.perf_counter() - t0)
        return True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _record_build(directory: Path, recipe: Recipe, seconds: float) -> None:
    """One line per compile in builds.log: when the kernels were built, by whom, how long."""
    entry = {
        "module": recipe.module_name,
        "pid": os.getpid(),
        "seconds": round(seconds, 1),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    with open(directory / "builds.log", "a") as f:
        f.write(json.dumps(entry) + "\n")


def main() -> int:
    t0 = time.perf_counter()
    module = extension()
    seconds = time.perf_counter() - t0
    if module is None:
        print(f"CPU kernels unavailable, torch's ops will be used ({seconds:.0f} s)")
        return 1
    print(f"CPU kernels ready ({seconds:.0f} s): {module.__file__}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
