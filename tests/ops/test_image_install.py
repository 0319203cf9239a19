"""ops/image-install.sh (the image's build stage) refuses a build that lacks what it was told to
use, with one line naming it, before it changes anything (no environment made, no certificate
installed): run here on the host with its inputs in a temporary folder."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "ops" / "image-install.sh"


def run(tmp_path: Path, offline: str) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "OFFLINE": offline,
        "OFFLINE_DIR": str(tmp_path / "offline"),
        "VENV": str(tmp_path / "venv"),
        "TORCH_VERSION": "2.13.0",
        "TORCH_INDEX_URL": "http://127.0.0.1:9/unreachable",
        "KVSERVE_CACHE_DIR": str(tmp_path / "models"),
    }
    return subprocess.run(["sh", str(SCRIPT)], env=env, capture_output=True, text=True)


@pytest.mark.parametrize(
    ("files", "offline", "names"),
    [
        ({}, "1", "ops/offline/wheels holds no torch wheel"),
        ({"wheels/torch-2.13.0-cp311-none-any.whl": b""}, "1", "no .gguf model file"),
        ({"certs/proxy.crt": b"not a certificate\n"}, "0", "proxy.crt is not a PEM certificate"),
        (
            {"certs/proxy.crt": b"-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"},
            "1",
            "proxy.crt is not a PEM certificate",
        ),
    ],
)
def test_missing_or_bad_inputs_fail_with_one_line_and_change_nothing(
    tmp_path: Path, files: dict[str, bytes], offline: str, names: str
) -> None:
    for rel, data in files.items():
        path = tmp_path / "offline" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    result = run(tmp_path, offline)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvserve image: ") and names in lines[0]
    assert not (tmp_path / "venv").exists() and not (tmp_path / "models").exists()
