"""The OS's view of a process's memory: a cross-check on the executor's own ledger of what it allocated.

The ledger is exact about the executor's buffers; the resident set's high-water mark also sees what the
ledger cannot (the allocator's slack, torch's temporaries), so the report shows both. Linux only: where
``/proc`` or glibc is missing, the figures are ``None``.
"""

from __future__ import annotations

import contextlib
import ctypes

from liver.bench.stream.workload import KIB


def _malloc_trim() -> None:
    """Give freed heap memory back to the OS, so the resident set before a stream is only what is live."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def status_kib(field: str) -> int | None:
    """A ``/proc/self/status`` figure in KiB (``VmRSS``, ``VmHWM``, ...), or None."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_peak_rss() -> int | None:
    """Reset the kernel's resident-set high-water mark; the resident set now (bytes), or None."""
    _malloc_trim()
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        return None
    now = status_kib("VmRSS")
    return None if now is None else now * KIB
