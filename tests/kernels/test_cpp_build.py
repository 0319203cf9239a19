"""The CPU kernels are built once per machine, found by later processes without a compiler, and
no build (killed, concurrent, corrupt, impossible) ever hangs or crashes a process.

The build mechanics are tested on a tiny extension (tiny_ext.cpp, no torch: a fraction of a
second to compile) in child processes (build_probe.py), with a stand-in compiler where a test
must stop or count compiles; the real kernels are checked for what set-up leaves behind.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from kvserve.kernels import (
    cpp_build,
    cpu_decode_attention,
    cpu_decode_step,
    cpu_linear,
    cpu_ops,
    cpu_prefill_attention,
)
from kvserve.shared.config import cache_dir

from tests.kernels.build_probe import recipe

PROBE = Path(__file__).with_name("build_probe.py")
ROOT = Path(__file__).resolve().parents[2]  # where `tests` is a package, for child processes

needs_compiler = pytest.mark.skipif(
    cpp_build.extension() is None, reason="no C++ toolchain: the kernels run on torch"
)


def probe(directory: Path, *flags: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(PROBE), str(directory), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def answer(proc: subprocess.Popen[str]) -> tuple[int | None, str]:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out)["answer"], err


def builds(directory: Path) -> int:
    log = directory / "builds.log"
    return len(log.read_text().splitlines()) if log.exists() else 0


def fake_compiler(tmp_path: Path, block: bool) -> Path:
    """A stand-in for c++ that, when it compiles (-c), appends its pid to `calls` and then
    (block=True) writes its pid to the fifo `started` and waits for a line on the fifo `go`;
    then it runs the real compiler."""
    script = tmp_path / "cxx"
    wait = f'echo $$ > "{tmp_path}/started"; read line < "{tmp_path}/go"; ' if block else ""
    script.write_text(
        "#!/bin/sh\n"
        f'case " $* " in *" -c "*) echo $$ >> "{tmp_path}/calls"; {wait};; esac\n'
        'exec c++ "$@"\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    if block:
        os.mkfifo(tmp_path / "started")
        os.mkfifo(tmp_path / "go")
    return script


# ---- the real kernels ------------------------------------------------------------------------


@needs_compiler
def test_every_kernel_wrapper_uses_the_one_library() -> None:
    ext = cpp_build.extension()
    assert ext is not None
    for module in (
        cpu_ops,
        cpu_linear,
        cpu_decode_attention,
        cpu_decode_step,
        cpu_prefill_attention,
    ):
        assert module._extension() is ext
    exported = ["rms_norm", "add_rms_norm", "rope_", "silu_mul", "argmax_logsumexp", "store_kv"]
    exported += ["linear", "geometry", "paged_decode", "prefill_attention", "decode_layers"]
    for fn in exported:
        assert callable(getattr(ext, fn)), fn
    assert Path(ext.__file__).parent == cpp_build.kernel_dir() == cache_dir() / "kernels"


@needs_compiler
def test_a_process_after_setup_compiles_nothing(tmp_path: Path) -> None:
    """The library set-up built is loaded as it is: no compiler runs (a stand-in compiler that
    records every call stays uncalled), the file is untouched, builds.log gains no line."""
    library = cpp_build.library_path(cpp_build.kernels_recipe(), cpp_build.kernel_dir())
    before = (library.stat().st_mtime_ns, builds(cpp_build.kernel_dir()))
    cxx = fake_compiler(tmp_path, block=False)
    code = "from kvserve.kernels import cpp_build; print(cpp_build.extension().__file__)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "CXX": str(cxx)},
        check=True,
    )
    assert done.stdout.strip() == str(library)
    assert not (tmp_path / "calls").exists()
    assert (library.stat().st_mtime_ns, builds(cpp_build.kernel_dir())) == before
    assert done.stderr == ""


@needs_compiler
def test_loading_the_kernels_keeps_subnormal_floats() -> None:
    """Compiled with -ffast-math, linked without it: loading the library must not switch the
    process to flush-to-zero (GCC's crtfastmath.o would, for every float op of the process)."""
    code = (
        "import sys; from kvserve.kernels import cpp_build; assert cpp_build.extension(); "
        "assert sys.float_info.min / 2 > 0, 'subnormals flushed'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_a_fast_math_library_keeps_subnormal_floats(tmp_path: Path) -> None:
    code = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r}); from pathlib import Path; "
        "from tests.kernels.build_probe import recipe; "
        "from kvserve.kernels.cpp_build import load_or_build; "
        f"assert load_or_build(recipe('-ffast-math'), Path({str(tmp_path)!r})).answer() == 42; "
        "assert sys.float_info.min / 2 > 0, 'subnormals flushed'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_the_key_changes_with_what_changes_the_binary(tmp_path: Path) -> None:
    base = recipe()
    assert recipe().key == base.key
    assert recipe("-DOTHER").key != base.key
    source = tmp_path / "tiny_ext.cpp"
    source.write_text(base.main.read_text() + "\n// edited\n")
    assert cpp_build.Recipe("tiny", source, (), base.cflags, torch=False).key != base.key
    assert len(cpp_build.kernels_recipe().key) == 16


def test_the_setup_entry_point_reports_the_build() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvserve.kernels.cpp_build"],
        capture_output=True,
        text=True,
        check=False,
    )
    if cpp_build.extension() is None:
        assert done.returncode == 1
        assert done.stdout.startswith("CPU kernels unavailable")
    else:
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith("CPU kernels ready")


# ---- build mechanics, on the tiny extension --------------------------------------------------


def test_built_once_then_loaded(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    value, err = answer(probe(lib))
    assert value == 42
    assert err.startswith("kvserve: building the CPU kernels for this machine into")
    assert answer(probe(lib)) == (42, "")
    assert builds(lib) == 1
    assert not list(lib.glob("build-*"))


def test_a_killed_builder_does_not_hold_up_the_next_process(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    cxx = fake_compiler(tmp_path, block=True)
    killed = probe(lib, env={"CXX": str(cxx)})
    with open(tmp_path / "started") as f:  # the builder holds the lock and is compiling
        compiler_pid = int(f.readline())
    assert len(list(lib.glob("build-*"))) == 1
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    os.kill(compiler_pid, signal.SIGKILL)  # the orphaned stand-in compiler
    value, err = answer(probe(lib))
    assert value == 42
    assert "waiting" not in err  # the dead builder's lock went with it
    assert builds(lib) == 1
    assert not list(lib.glob("build-*"))  # its temporary directory was removed


def test_two_processes_starting_at_once_build_once(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    cxx = fake_compiler(tmp_path, block=True)
    procs = [probe(lib, env={"CXX": str(cxx)}) for _ in range(2)]
    with open(tmp_path / "started") as f:
        f.readline()
    assert procs[0].stderr is not None and procs[1].stderr is not None
    firsts = sorted(p.stderr.readline() for p in procs)  # type: ignore[union-attr]
    assert firsts[0].startswith("kvserve: building the CPU kernels")
    assert firsts[1].startswith("kvserve: waiting up to 300 s for the CPU kernels that ")
    with open(tmp_path / "go", "w") as f:
        f.write("go\n")
    assert [answer(p)[0] for p in procs] == [42, 42]
    assert len((tmp_path / "calls").read_text().split()) == 1
    assert builds(lib) == 1


def test_the_wait_for_a_live_builder_is_bounded(tmp_path: Path) -> None:
    import fcntl

    lib = tmp_path / "lib"
    lib.mkdir()
    with open(lib / "build.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        value, err = answer(probe(lib, env={cpp_build.WAIT_ENV: "0.3"}))
    assert value is None
    lines = err.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("kvserve: waiting up to 0 s")
    assert lines[1] == (
        "kvserve: gave up after 0 s waiting for the CPU kernels' build; using torch's ops"
    )


@pytest.mark.parametrize("damage", ["cut-24", "cut-1000", "cut-half", "cut-1", "junk", "other"])
def test_a_bad_library_is_rebuilt_not_loaded(tmp_path: Path, damage: str) -> None:
    lib = tmp_path / "lib"
    assert answer(probe(lib))[0] == 42
    path = cpp_build.library_path(recipe(), lib)
    data = path.read_bytes()
    if damage == "junk":
        path.write_bytes(b"\x7fELF" + os.urandom(len(data)))
    elif damage == "other":  # a library built for another key (other flags, CPU or sources)
        answer(probe(tmp_path / "other", "-DOTHER"))
        (tmp_path / "other" / cpp_build.library_path(recipe("-DOTHER"), lib).name).rename(path)
    else:
        cut = {"cut-24": 24, "cut-1000": 1000, "cut-half": len(data) // 2, "cut-1": len(data) - 1}
        path.write_bytes(data[: cut[damage]])
    value, err = answer(probe(lib))
    assert value == 42
    lines = err.strip().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(f"kvserve: CPU kernel library {path} ")
    assert lines[0].endswith("; building it again")
    assert lines[1].startswith("kvserve: building the CPU kernels")
    assert builds(lib) == 2
    cpp_build.verify(path, recipe().key)


def test_no_compiler_means_torch_in_one_line(tmp_path: Path) -> None:
    value, err = answer(probe(tmp_path / "lib", env={"CXX": "/nonexistent/c++"}))
    assert value is None
    assert err.strip() == (
        "kvserve: no C++ compiler (/nonexistent/c++) for the CPU kernels; using torch"
    )


def test_a_failed_compile_means_torch_in_one_line(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    value, err = answer(probe(lib, "-DKVSERVE_MODULE=1+"))
    assert value is None
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvserve: the CPU kernels did not compile (")
    assert last.endswith("; using torch")
    assert builds(lib) == 0
    assert not list(lib.glob("*.so"))


def test_the_kernels_march_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    native = cpp_build.kernels_recipe()
    assert "-march=native" in native.cflags
    monkeypatch.setenv(cpp_build.ARCH_ENV, "x86-64-v3")
    avx2 = cpp_build.kernels_recipe()
    assert "-march=x86-64-v3" in avx2.cflags and "-march=native" not in avx2.cflags
    assert avx2.key != native.key  # a library of its own
    # ... the same on every CPU (a shared volume holds one), where a native build is per CPU
    monkeypatch.setattr(cpp_build, "_cpu_flags", lambda: "flags : fpu sse2 avx2")
    assert cpp_build.kernels_recipe().key == avx2.key
    monkeypatch.delenv(cpp_build.ARCH_ENV)
    assert cpp_build.kernels_recipe().key != native.key
