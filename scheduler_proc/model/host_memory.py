"""Keeps the scheduler's freed host memory in the process instead of handing it back to the
kernel after every step.

Why: a CPU forward allocates and frees the same large buffers every step (gathered keys and
values, scores, activations). By default glibc returns a freed chunk that large to the
kernel (``munmap``, or trimming the heap's top), and the next step faults every page back
in; under a VM such as Firecracker those faults cost a large step more system time than the
forward's own arithmetic (bench/README.md). With the two settings below the step reuses the
heap. The price, that the heap keeps its peak: ``keep_freed_host_memory``.

Only glibc has these knobs (``mallopt``); anywhere else this does nothing. Device memory
(CUDA) has its own caching allocator and is not touched.
"""

from __future__ import annotations

import ctypes
import os

# mallopt parameter numbers, from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Allocations below this come from the heap, not their own mmap; freed heap space at the
# top is kept up to this much. Explicit values also turn off glibc's dynamic thresholds,
# which only rise after a large chunk has already been unmapped once.
_KEEP_BYTES = 1 << 30


def keep_freed_host_memory() -> bool:
    """Sets glibc's mmap and trim thresholds for this process (idempotent). Returns whether
    they were set: False off glibc (musl, macOS, Windows).

    The price: the heap keeps its peak. The memory kept is what the largest step needed
    (more for long contexts), and the next step of that size needs it again, so the resident
    set stays at the step's peak instead of dipping between steps. A single allocation of
    ``_KEEP_BYTES`` or more still gets its own mapping and is returned on free; that is where
    a one-off spike (a huge prefill) would cost most to keep."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):  # glibc answers; others raise or say None
            return False
    except (AttributeError, ValueError, OSError):
        return False
    try:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 when glibc refuses the value.
    return bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _KEEP_BYTES)
    )
