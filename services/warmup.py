"""`kvserve warmup FILE`: a shared-prefix warm-up job. Computes the KV blocks of system prompts,
chat message lists and few-shot prefixes, writes them to the prefix store and pins them, so the
first request that starts with such a prefix finds those tokens cached.

FILE holds JSON lines, one prefix each (services/gateway/prefixes.py): {"text": ...},
{"system": ...} or {"messages": [...]}, optionally with "cache_salt". Prefixes whose blocks are
all stored already are skipped, so an interrupted job resumes where it stopped. `--store URL`
runs the job in this process against that store; `--server URL` submits it to a running gateway
(POST /v1/cache/warmup) and follows the job's status.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvserve.services.cli_support import CliError
from kvserve.services.gateway.prefixes import check_prefix, prefix_ids
from kvserve.shared.config import DEFAULT_STORE, default_model_path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("warmup", help="compute, store and pin the KV blocks of shared prefixes")
    p.add_argument("file", type=Path, help="JSON lines: {text|system|messages: ...}")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--store", default=DEFAULT_STORE, metavar="URL")
    where.add_argument("--server", metavar="URL", help="a kvserve gateway, e.g. http://h:8000")
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--api-key", default=None, help="bearer token for --server")
    p.set_defaults(handler=run)


def read_jobs(path: Path) -> list[dict[str, Any]]:
    """The file's prefixes, validated; CliError naming the line for anything malformed."""
    if not path.is_file():
        raise CliError(f"{path}: no such file")
    jobs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise CliError(f"{path}:{n}: not JSON ({e.msg})") from e
        error = check_prefix(obj)
        if error is not None:
            raise CliError(f"{path}:{n}: {error}")
        jobs.append(obj)
    if not jobs:
        raise CliError(f"{path}: no prefixes")
    return jobs


def run(args: argparse.Namespace) -> int:
    jobs = read_jobs(args.file)
    if args.server:
        return _run_remote(args, jobs)
    from kvserve.shared.config import EngineConfig, StoreConfig
    from kvserve.shared.engine.engine import Engine
    from kvserve.shared.model.tokenizer import ChatTemplateError
    from kvserve.shared.sampling_params import InvalidRequestError
    from kvserve.shared.store.backends import check_store_url
    from tqdm import tqdm

    if args.store != DEFAULT_STORE:
        try:
            check_store_url(args.store)
        except ValueError as e:
            raise CliError(f"--store: {e}") from e
    totals = {"prefixes": len(jobs), "computed": 0, "skipped": 0, "blocks": 0, "published": 0}
    with Engine(EngineConfig(model_path=args.model, store=StoreConfig(url=args.store))) as eng:
        bar = tqdm(jobs, desc="warm-up", unit="prefix", disable=not sys.stderr.isatty())
        t0 = time.perf_counter()
        for i, job in enumerate(bar):
            try:
                ids = prefix_ids(eng.tokenizer, job)
                got = eng.warmup(ids, job.get("cache_salt"), request_id=f"warmup-{i}")
            except (InvalidRequestError, ChatTemplateError) as e:
                raise CliError(f"{args.file}: prefix {i + 1}: {e}") from e
            for k in ("computed", "skipped", "blocks", "published"):
                totals[k] += got[k]
            bar.set_postfix(blocks=totals["blocks"], skipped=totals["skipped"])
    print(json.dumps({**totals, "seconds": round(time.perf_counter() - t0, 3)}))
    return 0


def _run_remote(args: argparse.Namespace, jobs: list[dict[str, Any]]) -> int:
    """Submit the job to a gateway and poll its status until it is done."""
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    base = args.server.rstrip("/")

    def call(method: str, path: str, body: Any = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(base + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(req, timeout=30) as resp:
                result: dict[str, Any] = json.loads(resp.read())
                return result
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read())["error"]["message"]
            except Exception:
                msg = e.reason
            raise CliError(f"--server: {e.code} {msg}") from e
        except (urllib.error.URLError, OSError) as e:
            raise CliError(f"--server: cannot reach {base}: {e}") from e

    job = call("POST", "/v1/cache/warmup", {"prefixes": jobs})
    status = job
    while status.get("status") not in ("completed", "failed"):
        time.sleep(0.2)  # polling a remote job's status endpoint
        status = call("GET", f"/v1/cache/warmup/{job['id']}")
    print(json.dumps(status))
    return 0 if status["status"] == "completed" else 1
