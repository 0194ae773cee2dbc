"""What ``health`` says of the process itself: its version and since when it runs."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import time


@functools.cache
def daemon_version() -> str:
    """The installed ``prismd`` distribution's version (``"unknown"`` when not installed)."""
    try:
        return importlib.metadata.version("prismd")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.cache
def process_started_ms() -> int:
    """When this process started, in Unix ms: from ``/proc`` (boot time plus the process's
    start in clock ticks), else the first call's time."""
    try:
        with open("/proc/self/stat", "rb") as file:
            # The command name (field 2) may hold spaces: count from its closing ')'.
            fields = file.read().rpartition(b")")[2].split()
        ticks = int(fields[19])  # field 22, starttime
        with open("/proc/stat", "rb") as file:
            boot = next(int(line.split()[1]) for line in file if line.startswith(b"btime "))
        return (boot * 1000) + ticks * 1000 // os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time_ns() // 1_000_000
