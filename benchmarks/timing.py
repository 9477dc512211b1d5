"""Timing that waits for the device, and the process's memory high-water mark."""

import ctypes
import ctypes.util
import resource
import time

import torch


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str) -> float:
    """Wall-clock seconds taken by fn(), the device's queue included."""
    return timed_cpu(fn, device)[0]


def timed_cpu(fn, device: str):
    """(wall seconds, CPU seconds of this process) taken by fn(). On a shared machine the CPU time
    is the steadier of the two: it leaves out the time other processes held the cores."""
    synchronize(device)
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    synchronize(device)
    return time.perf_counter() - wall, time.process_time() - cpu


def peak_rss_mb() -> float:
    """Peak resident memory of this process (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def return_freed_memory() -> bool:
    """From now on give every block of 128 KiB or more its own mapping, returned to the system when
    freed (glibc's mallopt M_MMAP_THRESHOLD; False where the C library has none). By default glibc
    raises that threshold as blocks are freed and serves later ones from its heap, whose freed holes
    stay resident: the peak RSS then depends on the order of allocations as much as on the memory in
    use, and identical code measures tens of MB apart between processes (BENCHMARKS.md)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    mallopt = getattr(libc, "mallopt", None)
    M_MMAP_THRESHOLD = -3
    return bool(mallopt and mallopt(M_MMAP_THRESHOLD, 128 * 1024))


DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
