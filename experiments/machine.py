"""What a measurement ran on, recorded beside its numbers."""

import os
import platform


def cpu_name():
    """The CPU model as /proc/cpuinfo names it (Linux), else what platform knows."""
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_kernels():
    """Which of torch's CPU kernel sets runs here: DEFAULT, AVX2 or AVX512 (the widest the CPU has,
    unless ATEN_CPU_CAPABILITY lowers it). Each set rounds differently, so the same training gives
    other numbers under another, even on CPUs with the same model name."""
    import torch

    return torch.backends.cpu.get_cpu_capability()


def cpu_with_kernels():
    """'AMD EPYC (AVX512 kernels)': the CPU model and torch's kernel set, which together decide the
    floating-point results of a training run."""
    return f"{cpu_name()} ({cpu_kernels()} kernels)"


def machine():
    """The CPU model, torch's CPU kernels, the core count and Python's version."""
    return {
        "cpu": cpu_name(),
        "cpu_capability": cpu_kernels(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
    }
