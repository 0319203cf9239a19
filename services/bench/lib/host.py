"""The machine a benchmark ran on, in words: CPU model, the vector ISA that decides kvserve's
kernels (AVX2, AVX-512, VNNI, AMX), and the cores this process may use. Reads /proc/cpuinfo;
no torch."""

from __future__ import annotations

import os
import platform

ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile")


def describe_cpu() -> str:
    model, flags = platform.processor() or platform.machine(), set[str]()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass
    isa = " ".join(flag for flag in ISA_FLAGS if flag in flags) or "no AVX2"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{model} ({isa}), {cores} cores"
