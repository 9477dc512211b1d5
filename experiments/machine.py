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


def machine():
    """The CPU model, the core count and Python's version."""
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "python": platform.python_version()}
