"""Benchmark the Triton kernels on a CUDA device: check each against kernels.reference at realistic
sizes, then report achieved bandwidth (store_kv, quantize, paged decode) or FLOP/s (prefill) as a
fraction of the device's peak, next to torch's scaled_dot_product_attention on the same work.

    .venv/bin/python ops/gpu_bench.py                  # H200 / H100 SXM: peaks from the table
    .venv/bin/python ops/gpu_bench.py --peak-bw 2.0 --peak-tflops 312   # any other device
    .venv/bin/python ops/gpu_bench.py --smoke          # tiny shapes (runs on the CPU too)

Model shape: 32 query heads, 8 KV heads, head_dim 128, bf16 (Llama-3-8B-like), block size 16.
Bytes and FLOPs are what the work needs, not what a kernel happens to move:
- store_kv: read K and V of T tokens, write them (and their scales) into the cache.
- decode: read each sequence's K/V once (plus scales); query and output are negligible.
- prefill: 4 * h * d * (number of (query, key) pairs the causal mask allows).
The SDPA baseline gets each sequence's K/V as one contiguous [kvh, len, d] tensor (decode) or the
whole causal prompt (prefill), with GQA (expanded to all heads if no fused backend takes GQA).
Exit status: 0 when every check passes (or there is no CUDA device), 1 otherwise.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

# (TB/s, dense bf16 TFLOP/s) by a substring of torch.cuda.get_device_name()
PEAKS: dict[str, tuple[float, float]] = {
    "H200": (4.8, 989.0),
    "H100 SXM": (3.35, 989.0),
    "H100 80GB HBM3": (3.35, 989.0),  # how the SXM part names itself
}
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
DTYPE = torch.bfloat16
# (batch, context length)
DECODE_SIZES = [(1, 1024), (1, 32768), (16, 8192), (64, 4096), (256, 1024), (256, 4096),
                (32, 32768)]  # fmt: skip
# (batch, chunk length, context length incl. the chunk); chunk == context: a whole prompt
PREFILL_SIZES = [(1, 1024, 1024), (1, 8192, 8192), (1, 32768, 32768), (8, 2048, 2048),
                 (1, 512, 8192), (4, 2048, 32768)]  # fmt: skip
STORE_TOKENS = [256, 8192]
SMOKE_DECODE, SMOKE_PREFILL, SMOKE_STORE = [(2, 100)], [(2, 40, 70), (1, 48, 48)], [24]
REF_MAX_PAIRS = 8192 * 8192  # the reference's masked SDPA materializes [h, q, ctx] scores
# (atol, rtol) of the checks, as in tests/kernels
TOLERANCE = {
    torch.bfloat16: (2e-2, 2e-2),
    torch.int8: (3e-2, 2e-2),
    torch.float8_e4m3fn: (3e-2, 2e-2),
}


@dataclass(frozen=True)
class Peak:
    bytes_per_s: float | None
    flops_per_s: float | None


@dataclass(frozen=True)
class Row:
    """One measured configuration: the Triton kernel, and the baseline when there is one."""

    kernel: str
    config: str
    ms: float
    work: float  # bytes or FLOPs
    unit: str  # "B" or "FLOP"
    base_ms: float | None
    base_name: str
    check: str


def device_peak(name: str, peak_bw: float | None, peak_tflops: float | None) -> Peak:
    """Flags win over the table; the table matches a substring of the device name."""
    table = next((v for k, v in PEAKS.items() if k in name), None)
    bw = peak_bw if peak_bw is not None else (table[0] if table else None)
    tf = peak_tflops if peak_tflops is not None else (table[1] if table else None)
    return Peak(bw * 1e12 if bw else None, tf * 1e12 if tf else None)


def make_timer(device: str) -> Callable[[Callable[[], object]], float]:
    """Milliseconds per call: triton.testing.do_bench (median, L2 flushed) on CUDA."""
    if device == "cuda":
        from triton.testing import do_bench

        return lambda fn: float(do_bench(fn, warmup=25, rep=100, return_mode="median"))

    def cpu_timer(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3

    return cpu_timer


def check_close(got: torch.Tensor, want: torch.Tensor, cache_dtype: torch.dtype) -> str:
    atol, rtol = TOLERANCE[cache_dtype]
    err = (got.float() - want.float()).abs()  # [...]
    ok = bool((err <= atol + rtol * want.float().abs()).all()) and not got.isnan().any()
    return f"{'ok' if ok else 'FAIL'} max|err| {err.max().item():.1e}"


# ---------------------------------------------------------------------------------------------
# Paged caches
# ---------------------------------------------------------------------------------------------


@dataclass
class Paged:
    k_cache: torch.Tensor  # [nb, bs, kvh, d]
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None  # [nb, bs, kvh]
    v_scale: torch.Tensor | None
    block_tables: torch.Tensor  # [B, n] int32, a random permutation of the blocks
    k_dense: torch.Tensor  # [B, kvh, len, d] bf16: the same K, contiguous per sequence (SDPA)
    v_dense: torch.Tensor


def make_paged(batch: int, length: int, cache_dtype: torch.dtype, device: str) -> Paged:
    """`batch` sequences of `length` tokens each in a shuffled paged cache."""
    from kvserve.kernels.quant import dequantize_kv, quantize_kv

    n = math.ceil(length / BLOCK_SIZE)
    perm = torch.randperm(batch * n, device=device)
    tables = perm.view(batch, n).int()  # [B, n]
    dense_shape = (batch, n * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k = torch.randn(dense_shape, device=device, dtype=DTYPE)  # [B, n*bs, kvh, d]
    v = torch.randn(dense_shape, device=device, dtype=DTYPE)
    cache_shape = (batch * n, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    inverse = torch.argsort(perm)  # physical block -> (b * n + j)
    k_paged = k.view(batch * n, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)[inverse].view(cache_shape)
    v_paged = v.view(batch * n, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)[inverse].view(cache_shape)
    k_scale = v_scale = None
    if cache_dtype != DTYPE:
        k_paged, k_scale = quantize_kv(k_paged, cache_dtype)
        v_paged, v_scale = quantize_kv(v_paged, cache_dtype)
        # the dense copies hold what the cache holds: logical block b * n + j is perm[b * n + j]
        k = dequantize_kv(k_paged, k_scale, DTYPE)[perm.long()].view(dense_shape)
        v = dequantize_kv(v_paged, v_scale, DTYPE)[perm.long()].view(dense_shape)
    k_dense = k[:, :length].transpose(1, 2).contiguous()  # [B, kvh, len, d]
    v_dense = v[:, :length].transpose(1, 2).contiguous()
    return Paged(k_paged, v_paged, k_scale, v_scale, tables, k_dense, v_dense)


def sdpa_fn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
) -> tuple[Callable[[], torch.Tensor], str]:
    """SDPA on contiguous q [B, h, q, d], k/v [B, kvh, len, d]: fused GQA ('sdpa') when a backend
    takes it, else with K/V expanded to all h heads ('sdpa*', which reads group x the bytes)."""
    f = torch.nn.functional.scaled_dot_product_attention
    try:
        f(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)
        return (lambda: f(q, k, v, is_causal=causal, scale=scale, enable_gqa=True)), "sdpa"
    except (RuntimeError, TypeError):
        group = q.shape[1] // k.shape[1]
        ke, ve = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return (lambda: f(q, ke, ve, is_causal=causal, scale=scale)), "sdpa*"


def kv_bytes(tokens: int, cache_dtype: torch.dtype) -> float:
    """K and V of `tokens` tokens as the cache stores them, scales included."""
    per = NUM_KV_HEADS * HEAD_DIM * cache_dtype.itemsize
    if cache_dtype != DTYPE:
        per += NUM_KV_HEADS * 4
    return 2.0 * tokens * per


# ---------------------------------------------------------------------------------------------
# Benchmarks
# ---------------------------------------------------------------------------------------------


def same_bits(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.dtype == torch.float8_e4m3fn:
        # -0 and +0 both decode to 0: a GPU's conversion may drop the sign of what rounds to zero
        a, b = (torch.where(t.view(torch.uint8) == 0x80, 0, t.view(torch.uint8)) for t in (a, b))
    return torch.equal(a, b)


def bench_quant(device: str, timer: Callable[[Callable[[], object]], float]) -> list[Row]:
    from kvserve.kernels import reference as ref
    from kvserve.kernels.quant import dequantize_kv, quantize_kv

    rows = []
    x = torch.randn(8192 if device == "cuda" else 64, NUM_KV_HEADS, HEAD_DIM, device=device)
    x = x.to(DTYPE)  # [T, kvh, d]
    for qd in (torch.int8, torch.float8_e4m3fn):
        q, s = quantize_kv(x, qd)
        q_ref, s_ref = ref.quantize_kv(x, qd)
        exact = same_bits(q, q_ref) and torch.equal(s, s_ref)
        back = dequantize_kv(q, s, DTYPE)
        exact_back = torch.equal(back, ref.dequantize_kv(q_ref, s_ref, DTYPE))
        check = "ok bit-exact" if exact and exact_back else "FAIL not bit-exact"
        if device != "cuda" and exact:  # the interpreter truncates fp32 -> bf16
            check = "ok (q, scale bit-exact)"
        moved = x.numel() * (x.element_size() + qd.itemsize) + s.numel() * 4
        name = str(qd).removeprefix("torch.")
        rows.append(
            Row(f"quantize {name}", f"T={x.shape[0]}", timer(partial(quantize_kv, x, qd)),
                moved, "B", timer(partial(ref.quantize_kv, x, qd)), "torch", check)
        )  # fmt: skip
    return rows


def reference_store(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> None:
    """reference.store_kv; an fp8 cache through byte views (torch has no float8 index_copy_)."""
    from kvserve.kernels import reference as ref

    if k_cache.dtype != torch.float8_e4m3fn:
        ref.store_kv(key, value, k_cache, v_cache, slots, k_scale, v_scale)
        return
    assert k_scale is not None and v_scale is not None
    for x, cache, scale in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        q, sc = ref.quantize_kv(x, cache.dtype)  # [T, kvh, d], [T, kvh]
        cache.view(torch.uint8).view(-1, NUM_KV_HEADS, HEAD_DIM).index_copy_(
            0, slots, q.view(torch.uint8)
        )
        scale.view(-1, NUM_KV_HEADS).index_copy_(0, slots, sc)


def bench_store(
    device: str, timer: Callable[[Callable[[], object]], float], sizes: list[int]
) -> list[Row]:
    from kvserve.kernels.reference import is_quantized
    from kvserve.kernels.store_kv import store_kv

    rows = []
    for tokens in sizes:
        for cd in (DTYPE, torch.float8_e4m3fn, torch.int8):
            nb = 2 * math.ceil(tokens / BLOCK_SIZE)
            shape = (nb, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)

            def cache(cd: torch.dtype = cd, shape: tuple[int, ...] = shape) -> torch.Tensor:
                return torch.zeros(shape, device=device, dtype=DTYPE).to(cd)

            def scale(cd: torch.dtype = cd, nb: int = nb) -> torch.Tensor | None:
                zeros = torch.zeros(nb, BLOCK_SIZE, NUM_KV_HEADS, device=device)
                return zeros if is_quantized(cd) else None

            got = (cache(), cache(), scale(), scale())  # k, v, k_scale, v_scale
            want = (cache(), cache(), scale(), scale())
            key = torch.randn(tokens, NUM_KV_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
            value = torch.randn_like(key)  # [T, kvh, d]
            slots = torch.randperm(nb * BLOCK_SIZE, device=device)[:tokens]  # [T] int64
            store_kv(key, value, got[0], got[1], slots, got[2], got[3])
            reference_store(key, value, want[0], want[1], slots, want[2], want[3])
            exact = all(same_bits(g, w) for g, w in zip(got, want, strict=True))
            check = "ok bit-exact" if exact else "FAIL not bit-exact"
            moved = 2.0 * key.numel() * key.element_size() + kv_bytes(tokens, cd)
            rows.append(
                Row(f"store_kv {str(cd).removeprefix('torch.')}", f"T={tokens}",
                    timer(partial(store_kv, key, value, got[0], got[1], slots, got[2], got[3])),
                    moved, "B",
                    timer(partial(reference_store, key, value, *want[:2], slots, *want[2:])),
                    "torch", check)
            )  # fmt: skip
    return rows


def bench_decode(
    device: str,
    timer: Callable[[Callable[[], object]], float],
    sizes: list[tuple[int, int]],
    cache_dtypes: list[torch.dtype],
) -> list[Row]:
    from kvserve.kernels import reference as ref
    from kvserve.kernels.paged_decode import paged_decode_attention

    rows = []
    scale = HEAD_DIM**-0.5
    for batch, length in sizes:
        for cd in cache_dtypes:
            p = make_paged(batch, length, cd, device)
            q = torch.randn(batch, NUM_HEADS, HEAD_DIM, device=device, dtype=DTYPE)  # [B, h, d]
            lens = torch.full((batch,), length, dtype=torch.int32, device=device)
            args = (q, p.k_cache, p.v_cache, p.block_tables, lens, scale, p.k_scale, p.v_scale)
            got = paged_decode_attention(*args)
            check = check_close(got, ref.paged_decode_attention(*args), cd)
            base_ms, base_name = None, "sdpa"  # SDPA only next to the bf16 cache
            if cd == DTYPE:
                q4 = q[:, :, None, :]  # [B, h, 1, d]
                base, base_name = sdpa_fn(q4, p.k_dense, p.v_dense, False, scale)
                base_ms = timer(base)
                del base
            name = str(cd).removeprefix("torch.")
            rows.append(
                Row(f"decode {name}", f"B={batch} ctx={length}",
                    timer(partial(paged_decode_attention, *args)),
                    kv_bytes(batch * length, cd), "B", base_ms, base_name, check)
            )  # fmt: skip
            del p, got
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def causal_pairs(q_len: int, ctx: int) -> int:
    """(query, key) pairs a chunk of q_len queries ending at position ctx - 1 attends to."""
    return q_len * (ctx - q_len) + q_len * (q_len + 1) // 2


def bench_prefill(
    device: str,
    timer: Callable[[Callable[[], object]], float],
    sizes: list[tuple[int, int, int]],
    cache_dtypes: list[torch.dtype],
) -> list[Row]:
    from kvserve.kernels import reference as ref
    from kvserve.kernels.prefill_attention import prefill_attention

    rows = []
    scale = HEAD_DIM**-0.5
    for batch, q_len, ctx in sizes:
        for cd in cache_dtypes:
            p = make_paged(batch, ctx, cd, device)
            q = torch.randn(batch * q_len, NUM_HEADS, HEAD_DIM, device=device, dtype=DTYPE)
            cu = torch.arange(0, batch + 1, dtype=torch.int32, device=device) * q_len  # [B + 1]
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
            args = (q, p.k_cache, p.v_cache, p.block_tables, cu, lens, scale, p.k_scale, p.v_scale)
            got = prefill_attention(*args)  # [T, h, d]
            q4 = q.view(batch, q_len, NUM_HEADS, HEAD_DIM).transpose(1, 2)  # [B, h, q, d]
            base, base_name = None, "sdpa"  # no SDPA twin for a chunk over a cached prefix
            if q_len == ctx:
                base, base_name = sdpa_fn(q4, p.k_dense, p.v_dense, True, scale)
            if q_len * ctx <= REF_MAX_PAIRS:
                check = check_close(got, ref.prefill_attention(*args), cd)
            elif base is not None:  # too big for the reference: SDPA is the oracle
                want = base()  # [B, h, q, d]
                check = check_close(got, want.transpose(1, 2).reshape(got.shape), cd) + " (sdpa)"
            else:
                check = "unchecked"
            flops = 4.0 * NUM_HEADS * HEAD_DIM * batch * causal_pairs(q_len, ctx)
            name = str(cd).removeprefix("torch.")
            rows.append(
                Row(f"prefill {name}", f"B={batch} q={q_len} ctx={ctx}",
                    timer(partial(prefill_attention, *args)), flops, "FLOP",
                    timer(base) if base is not None and cd == DTYPE else None, base_name, check)
            )  # fmt: skip
            del p, got, base
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def rate(work: float, ms: float, unit: str, peak: Peak) -> str:
    per_s = work / (ms * 1e-3)
    top = peak.bytes_per_s if unit == "B" else peak.flops_per_s
    label = "TB/s" if unit == "B" else "TFLOP/s"
    frac = f" {100 * per_s / top:5.1f}%" if top else "    n/a"
    return f"{per_s / 1e12:8.3f} {label:7s}{frac}"


def report(rows: list[Row], peak: Peak) -> None:
    print(f"{'kernel':24s} {'config':26s} {'ms':>9s} {'achieved / peak':>24s}   "
          f"{'baseline':8s} {'ms':>9s} {'achieved / peak':>24s}   check")  # fmt: skip
    for r in rows:
        base = (
            f"{r.base_name:8s} {r.base_ms:9.4f} {rate(r.work, r.base_ms, r.unit, peak)}"
            if r.base_ms is not None
            else f"{'-':8s} {'':9s} {'':24s}"
        )
        print(
            f"{r.kernel:24s} {r.config:26s} {r.ms:9.4f} {rate(r.work, r.ms, r.unit, peak)}   "
            f"{base}   {r.check}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peak-bw", type=float, help="peak memory bandwidth, TB/s")
    parser.add_argument("--peak-tflops", type=float, help="peak dense bf16 TFLOP/s")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; the CPU is allowed")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.smoke:
        print("gpu_bench: no CUDA device here; nothing to measure (use --smoke for a CPU dry run)")
        return 0
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (Triton interpreter)"
    peak = device_peak(name, args.peak_bw, args.peak_tflops)
    bw = f"{peak.bytes_per_s / 1e12:.2f} TB/s" if peak.bytes_per_s else "unknown (--peak-bw)"
    tf = f"{peak.flops_per_s / 1e12:.0f} TFLOP/s" if peak.flops_per_s else "unknown (--peak-tflops)"
    print(f"device: {name}; peak bandwidth {bw}, peak dense bf16 {tf}")
    print(f"model: h={NUM_HEADS} kvh={NUM_KV_HEADS} d={HEAD_DIM} bs={BLOCK_SIZE} {DTYPE}")
    torch.manual_seed(0)
    timer = make_timer(device)
    quant = [DTYPE, torch.float8_e4m3fn, torch.int8]
    rows = bench_quant(device, timer)
    rows += bench_store(device, timer, SMOKE_STORE if args.smoke else STORE_TOKENS)
    rows += bench_decode(device, timer, SMOKE_DECODE if args.smoke else DECODE_SIZES, quant)
    rows += bench_prefill(
        device, timer, SMOKE_PREFILL if args.smoke else PREFILL_SIZES, [DTYPE, torch.float8_e4m3fn]
    )
    report(rows, peak)
    failed = [r for r in rows if r.check.startswith("FAIL")]
    print(f"{len(rows) - len(failed)} of {len(rows)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
