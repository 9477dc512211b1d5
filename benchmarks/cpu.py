"""The CPU a measurement ran on, recorded beside every CPU result: its model and cores, the vector
instructions it has, and which of torch's kernel sets (DEFAULT, AVX2, AVX512) runs on it. The same
code measured QK-norm's training step at 1.000x stock's speed on an AMD EPYC and 0.95x on an Intel
Xeon with AVX-512 (BENCHMARKS.md): a CPU ratio means little without its CPU."""

import os

from experiments.machine import cpu_kernels, cpu_name

# The vector extensions, as /proc/cpuinfo names them, that decide which kernels torch, MKL and
# oneDNN run: widths (AVX2, AVX-512) and the bfloat16, float16 and matrix units.
VECTOR_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "amx_tile",
    "amx_bf16",
)


def vector_flags():
    """Those of VECTOR_FLAGS the CPU has (Linux); an empty list where /proc/cpuinfo is missing."""
    if not os.path.exists("/proc/cpuinfo"):
        return []
    with open("/proc/cpuinfo", encoding="utf-8") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    return [flag for flag in VECTOR_FLAGS if flag in flags]


def record():
    """What a results file says about its CPU: model, cores, torch's kernel set, vector flags."""
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "cpu_capability": cpu_kernels(),
        "cpu_flags": vector_flags(),
    }


def describe(rec):
    """'Intel(R) Xeon(R) Processor, 2 cores (torch's CPU kernels: AVX512; avx2 fma avx512f ...)'."""
    return f"{rec['cpu']}, {rec['cores']} cores ({isa(rec)})"


def isa(rec):
    return f"torch's CPU kernels: {rec['cpu_capability']}; {' '.join(rec['cpu_flags']) or 'no vector flags read'}"


def flush_denormals():
    """Flush denormal floats to zero in every thread torch computes in, or raise RuntimeError.
    torch.set_flush_denormal sets the calling thread's floating-point control; the threads torch
    starts afterwards inherit it, threads already running keep theirs. So it must come before
    torch's first parallel operation: a multiply over a tensor large enough for every thread to
    take a part checks that it did."""
    import torch

    if not torch.set_flush_denormal(True):
        raise RuntimeError("this CPU cannot flush denormals (torch.set_flush_denormal: x86 with SSE3 only)")
    # the smallest denormal, from its bits: made from a float, this thread would flush it already
    denormals = torch.ones(1 << 22, dtype=torch.int32).view(torch.float32)
    if (denormals * 1.0).count_nonzero():
        raise RuntimeError("denormals are flushed in this thread but not in torch's threads started before")
