"""The process harness (services/bench/lib/process.py) on small Python children: ready at the
`ready` log event with its URL, a child that exits or never answers is a StartError, stopping
reaches the whole process group, a stopped process restarts with its log appended."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kvserve.services.bench.lib.process import HttpReady, ServerProcess, StartError, free_port
from kvserve.services.bench.lib.readiness import poll_until

READY = (
    'import json, sys, time; print("starting", file=sys.stderr, flush=True); '
    'print(json.dumps({"event": "ready", "url": "http://127.0.0.1:9"}), file=sys.stderr, '
    "flush=True); time.sleep(60)"
)


def python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def ended(pid: int) -> bool:
    """The process is gone, or a zombie nobody has reaped yet (it runs no more)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_ready_at_the_log_event_with_its_url(tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    with ServerProcess("child", python(READY), log=log) as p:
        assert p.url == "http://127.0.0.1:9"
        assert [e["event"] for e in p.events()] == ["ready"]
        assert p.lines()[0] == "starting\n" and p.running
    assert not p.running and p.proc is not None and p.proc.returncode is not None
    text = log.read_text()
    assert text.startswith(f"$ {sys.executable} -c") and '"event": "ready"' in text


def test_a_child_that_exits_first_is_a_start_error() -> None:
    code = 'import sys; print("no model here", file=sys.stderr); sys.exit(3)'
    with pytest.raises(StartError, match="no model here"):
        ServerProcess("child", python(code)).start(timeout=60)


def test_a_child_that_never_answers_misses_its_deadline() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    p = ServerProcess("child", python("import time; time.sleep(60)"), ready=HttpReady(), url=url)
    with pytest.raises(StartError, match="not ready at"):
        p.start(timeout=0.5)
    assert not p.running  # stopped on the way out


def test_stop_reaches_the_process_group_and_spawn_restarts(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    code = (
        "import subprocess, sys; "
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        f"open({str(pid_file)!r}, 'w').write(str(c.pid)); {READY}"
    )
    p = ServerProcess("child", python(code), log=tmp_path / "child.log").start(timeout=60)
    grandchild = int(pid_file.read_text())
    p.stop(grace=10)
    poll_until(lambda: ended(grandchild))  # gone with its group
    p.spawn().wait_ready(60)
    assert p.running and len([e for e in p.events() if e["event"] == "ready"]) == 2
    p.kill()
    assert (tmp_path / "child.log").read_text().count("$ ") == 2
