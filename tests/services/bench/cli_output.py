"""What a `kvserve` command line printed: a benchmark's last stdout line as JSON, and a bad
option's error (exit status 2, one line on stderr), for the CLI tests too."""

from __future__ import annotations

import json
from typing import Any

import pytest
from kvserve.services import cli


def last_json(capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    lines = capsys.readouterr().out.strip().splitlines()
    out: dict[str, Any] = json.loads(lines[-1])
    return out


def one_line_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The command's stderr, once it exited with 2 after printing one line there."""
    assert cli.main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    return err
