"""Does the GPU path work, and how fast is it: one command for a CUDA machine (ops/gpu_check.sh).

Steps, each in its own process with its own time limit, its output in OUT/<step>.log:
  kernels       the Triton kernel tests, natively (tests/kernels/test_triton_*.py)
  engine        the engine on the device against the CPU engine and HF transformers
                (tests/shared/engine/test_device_engine.py, `-m gpu`)
  bench_engine  `kvserve bench engine --device cuda`: W1 against HF on the same device
  serve         the OpenAI suite and the rest of tests/services/test_serve_openai.py against
                `kvserve serve --device cuda`
  bench_serve   `kvserve bench serve --workload shared-prefix` against `kvserve serve --device cuda`
  gpu_bench     ops/gpu_bench.py: each Triton kernel against the reference and SDPA, % of peak
Then prints one JSON object (every step's pass/fail, seconds and figures; also OUT/summary.json)
and exits 1 if any step failed.

--model: a GGUF file or an HF directory (default: the default model). An HF directory that holds
config.json and tokenizer files but no weights gets random ones first (ops/random_weights.py, into
a copy under OUT): the speed is the model's, the answers are not (a machine that cannot fetch the
weights). --smoke runs every step on the CPU with tiny sizes (Triton's interpreter), so that the
script is tested where no GPU is (tests/ops/test_gpu_check.py).
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# The console script: `python -m` from the repository root would put its kernels/ folder ahead
# of the installed package of that name that transformers imports.
KVSERVE = [str(Path(PY).parent / "kvserve") if (Path(PY).parent / "kvserve").exists()
           else shutil.which("kvserve") or "kvserve"]  # fmt: skip
PYTEST = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
DEVICE_TESTS = "tests/shared/engine/test_device_engine.py"
SERVE_TESTS = "tests/services/test_serve_openai.py"


@dataclass
class Step:
    name: str
    cmd: list[str]
    timeout_s: float
    env: dict[str, str] = field(default_factory=dict)
    figures: Callable[[str], dict[str, Any]] = lambda log: {}
    run: Callable[[Any], int] | None = None  # instead of `cmd`: given the log file, the status


def pytest_counts(log: str) -> dict[str, Any]:
    """pytest's last summary line as counts: {"passed": 12, "failed": 1, ...}."""
    line = next((ln for ln in reversed(log.splitlines()) if re.search(r" in [\d.]+s", ln)), "")
    return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", line)}


def json_figures(path: Path, keys: tuple[str, ...]) -> Callable[[str], dict[str, Any]]:
    def read(_: str) -> dict[str, Any]:
        data = json.loads(path.read_text()) if path.exists() else {}
        data = data.get("summary", data)  # engine.json: {"summary": ..., "steps": ...}
        return {k: data.get(k) for k in keys}

    return read


def gpu_bench_figures(log: str) -> dict[str, Any]:
    m = re.search(r"(\d+) of (\d+) checks passed", log)
    return {"checks_passed": int(m[1]), "checks": int(m[2])} if m else {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def prepare_model(model: Path, out: Path) -> tuple[Path, bool]:
    """(the model to run, whether its weights are random)."""
    if model.is_file() or any(model.glob("*.safetensors")):
        return model, False
    if not (model / "config.json").is_file():
        raise SystemExit(f"gpu_check: no model at {model} (a GGUF file or an HF directory)")
    copy = out / "model"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(model, copy)
    subprocess.run([PY, str(ROOT / "ops" / "random_weights.py"), str(copy)], check=True)
    return copy, True


ENGINE_FIGURES = ("kvserve_tok_s", "hf_tok_s", "ratio", "engine_step_b1_ms", "engine_step_b8_ms",
                  "engine_step_b32_ms")  # fmt: skip
SERVE_FIGURES = ("completed", "failed", "output_tok_s", "ttft_mean_s", "tpot_mean_s",
                 "cached_tokens_total", "prompt_tokens_total")  # fmt: skip


def steps(args: argparse.Namespace, model: Path, out: Path) -> list[Step]:
    device = "cpu" if args.smoke else "cuda"
    env = {"KVSERVE_TEST_DEVICE": device, "KVSERVE_TEST_MODEL": str(model)}
    # The full-size engine test on the CPU would run 30 layers in Triton's interpreter.
    engine_env = env if model.is_dir() and not args.smoke else {"KVSERVE_TEST_DEVICE": device}
    kernels = sorted(str(p) for p in (ROOT / "tests" / "kernels").glob("test_triton_*.py"))
    # Triton compiles each kernel variant on the host: spread them over its cores where xdist is
    parallel = [] if args.smoke or not importlib.util.find_spec("xdist") else ["-n", "8"]
    sizes = ["--num-requests", "256"]
    if args.smoke:
        sizes = ["--num-requests", "8", "--max-prompt", "64", "--max-output", "16",
                 "--probe-steps", "2", "--probe-context", "32"]  # fmt: skip
    bench_engine = [*KVSERVE, "bench", "engine", "--device", device, "--model", str(model),
                    "--out", str(out / "bench_engine"), *sizes]  # fmt: skip
    engine_json = out / "bench_engine" / "engine.json"
    serve_json = out / "bench_serve" / "summary.json"
    gpu_bench = [PY, str(ROOT / "ops" / "gpu_bench.py"), *(["--smoke"] if args.smoke else [])]
    serve = functools.partial(run_bench_serve, 240, args, model, out)
    return [
        Step("kernels", [*PYTEST, *parallel, *kernels], 240, figures=pytest_counts),
        Step("engine", [*PYTEST, "-m", "gpu", DEVICE_TESTS], 240, engine_env, pytest_counts),
        Step("bench_engine", bench_engine, 240, figures=json_figures(engine_json, ENGINE_FIGURES)),
        Step("serve", [*PYTEST, SERVE_TESTS], 240, env, pytest_counts),
        Step("bench_serve", [], 240, figures=json_figures(serve_json, SERVE_FIGURES), run=serve),
        Step("gpu_bench", gpu_bench, 300, figures=gpu_bench_figures),
    ]


def run_bench_serve(
    timeout_s: float, args: argparse.Namespace, model: Path, out: Path, log: Any
) -> int:
    """`kvserve serve` on the device, then `kvserve bench serve` against it."""
    from kvserve.services.bench.lib.process import ServerProcess

    device = "cpu" if args.smoke else "cuda"
    port = free_port()
    server = ServerProcess(
        "serve",
        [*KVSERVE, "serve", "--model", str(model), "--device", device, "--port", str(port)],
        log=out / "bench_serve_server.log",
    )
    server.start(timeout=timeout_s / 2)
    try:
        n, groups = ("8", "2") if args.smoke else ("64", "8")  # 8 prompts a group
        bench = [*KVSERVE, "bench", "serve", "--base-url", server.url, "--workload",
                 "shared-prefix", "--num-requests", n, "--max-concurrency", n, "--out",
                 str(out / "bench_serve"), "--no-plots", "--groups", groups]  # fmt: skip
        if args.smoke:
            bench += ["--prefix-len", "64", "--question-len", "16", "--max-tokens", "8"]
        return subprocess.run(bench, stdout=log, stderr=subprocess.STDOUT,
                              timeout=timeout_s / 2, cwd=ROOT).returncode  # fmt: skip
    finally:
        server.stop()


def run_step(step: Step, out: Path) -> dict[str, Any]:
    log_path = out / f"{step.name}.log"
    t0 = time.perf_counter()
    with log_path.open("w") as log:
        try:
            if step.run is not None:
                rc = step.run(log)
            else:
                env = {**os.environ, **step.env}
                rc = subprocess.run(step.cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    timeout=step.timeout_s, cwd=ROOT).returncode  # fmt: skip
            error = None if rc == 0 else f"exit status {rc}"
        except subprocess.TimeoutExpired:
            error = f"ran past {step.timeout_s:.0f} s"
        except Exception as e:  # a step that cannot start fails itself, not the whole check
            error = f"{type(e).__name__}: {e}"
    text = log_path.read_text(errors="replace")
    try:
        figures = step.figures(text)
    except (OSError, ValueError) as e:
        figures = {"error": f"figures unreadable: {e}"}
    result = {"ok": error is None, "seconds": round(time.perf_counter() - t0, 1), **figures}
    if error:
        result["error"] = error
        result["log_tail"] = text[-1500:]
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes on the CPU")
    p.add_argument("--model", type=Path, default=None, help="GGUF file or HF directory")
    p.add_argument("--out", type=Path, default=Path("gpu-check"), help="logs and summary.json")
    p.add_argument("--only", default=None, help="comma list of steps to run (default: all)")
    args = p.parse_args(argv)
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (--smoke runs the steps on the CPU)", file=sys.stderr)
        return 2
    from kvserve.shared.config import default_model_path

    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out.resolve()
    model, random_weights = prepare_model((args.model or default_model_path()).resolve(), out)
    chosen = args.only.split(",") if args.only else None
    summary: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "smoke": args.smoke,
        "model": str(model),
        "random_weights": random_weights,
        "torch": torch.__version__,
        "steps": {},
    }
    for step in steps(args, model, out):
        if chosen and step.name not in chosen:
            continue
        summary["steps"][step.name] = result = run_step(step, out)
        print(f"gpu_check: {step.name}: {'ok' if result['ok'] else 'FAILED'} "
              f"({result['seconds']} s)", file=sys.stderr, flush=True)  # fmt: skip
    summary["ok"] = all(r["ok"] for r in summary["steps"].values())
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary))
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
