"""CPU host-memory default: let XLA:CPU reuse each step's working memory instead of faulting it in afresh.

``reuse_host_memory()`` is called first thing by a CPU run (before any device use: the backends' worker
threads take their malloc arena at their first allocation). On a GPU, or with a C library other than glibc,
it changes nothing.

Why (measured on the 2-core AMD EPYC VM, jaxlib 0.10.2, ``benchmarks/README.md``): XLA:CPU allocates one
temporary buffer per execution of a compiled program (all of its intermediate values: 287 MB for the Llama
step of ``benchmarks/vs_pytorch.py``, batch 32 x 128) on a worker thread, and frees it when the execution ends.
glibc's ``malloc`` serves a block that large with ``mmap`` (a worker thread's arena holds at most 64 MiB, and the
main arena's ``mmap`` threshold is at most 32 MiB) and gives it back with ``munmap``, so every step faults in
every 4 KiB page of the buffer again, each zero-filled by the kernel: 70,082 minor page faults and 115-175 ms of
system time in a step of 480-640 ms of CPU time on one core. With one arena, no ``mmap`` and no trimming of the
heap's top, the buffer freed by one step is the next step's: no page faults, 360-370 ms a step.

It is not a guarantee on every step: a small block that is allocated between two executions inside the freed buffer
and outlives the next one leaves too little room there, and the heap grows by one buffer (whose pages fault once).
On a 100 MiB buffer over 40 calls (``tests/test_host_memory.py``, 18 processes, idle and with two busy loops) that
happened on 0-9 of the 39 calls after the first, often on a few in a row, and on none of the others; each time the
process keeps one more buffer (peak resident memory 550 MB without the settings, 550-1,350 MB with them).

What it sets, through glibc's ``mallopt`` (mallopt(3)): ``M_ARENA_MAX`` 1, ``M_MMAP_MAX`` 0 and
``M_TRIM_THRESHOLD`` 2**31 - 1, the same as starting the process with the environment
``MALLOC_ARENA_MAX=1 MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=2147483647``. The costs: the process keeps its peak
heap (freed memory is not returned to the OS until it exits; it can hold several copies of the buffer, above), and
threads that allocate at once share one arena (no slowdown measured with XLA:CPU's pool on 2 cores).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
import platform as _platform
import warnings

from jaxpar import _compat
from jaxpar.tools.gpu import detect_platform

TRIM_THRESHOLD = 2**31 - 1
# glibc's mallopt parameter numbers (malloc.h): M_TRIM_THRESHOLD -1, M_MMAP_MAX -4, M_ARENA_MAX -8
MALLOPT: dict[str, tuple[int, int]] = {"M_ARENA_MAX": (-8, 1), "M_MMAP_MAX": (-4, 0),
                                       "M_TRIM_THRESHOLD": (-1, TRIM_THRESHOLD)}
"""What :func:`reuse_host_memory` sets: name -> (glibc's ``mallopt`` parameter number, value)."""
ENVIRONMENT: dict[str, str] = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0",
                               "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}
"""The same settings as glibc environment variables (read when a process starts)."""


@dataclasses.dataclass(frozen=True)
class HostMemory:
    """What :func:`reuse_host_memory` did.

    Attributes:
      platform: the platform seen (``"cpu"``, ``"gpu"``, ``None`` when undetected: treated as a CPU).
      settings: the ``mallopt`` settings applied (name -> value); empty when nothing was changed.
      reason: why nothing was changed (empty when ``settings`` were applied).
    """
    platform: str | None
    settings: dict[str, int]
    reason: str = ""

    @property
    def applied(self) -> bool:
        return bool(self.settings)


def _glibc() -> ctypes.CDLL | None:
    """The process's C library when it is glibc (Linux), else None."""
    if _platform.system() != "Linux" or _platform.libc_ver()[0] != "glibc":
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def reuse_host_memory(platform: str | None = None) -> HostMemory:
    """On a CPU run with glibc: ``malloc`` keeps and reuses the memory XLA:CPU frees after each execution (module
    docstring: one arena, no ``mmap``, no trimming); else nothing.

    Call it before anything starts JAX's backends (``jax.devices()``, any computation); importing jax is fine.
    Calling it again changes nothing more.

    Args:
      platform: force the platform (``"cpu"``, ``"gpu"``, ...); None detects it without starting JAX
        (:func:`jaxpar.tools.gpu.detect_platform`).

    Returns:
      A :class:`HostMemory`: the platform, the settings applied, or the reason none were.

    Raises:
      ValueError: ``platform`` not a non-empty string or None.
      OSError: glibc refused a setting (the ones before it stay applied).

    Warns:
      RuntimeWarning: on a CPU run, when JAX's backends already started: their worker threads hold their own
        arenas, where the settings would not reach XLA:CPU's buffers, so nothing is changed.
    """
    found = detect_platform(platform)
    if found == "gpu":
        return HostMemory(found, {}, "a GPU run: XLA's working memory is device memory")
    libc = _glibc()
    if libc is None:
        return HostMemory(found, {}, f"the C library is not glibc ({_platform.libc_ver()[0] or 'unknown'})")
    if _compat.backends_initialized():
        warnings.warn("jp.tools.cpu.reuse_host_memory() ran after JAX's backends started: XLA:CPU's worker threads "
                      "already have their malloc arenas, so nothing is changed; call it first thing in the program, "
                      "before jax.devices() or any computation (or start the process with "
                      + " ".join(f"{k}={v}" for k, v in ENVIRONMENT.items()) + ")", RuntimeWarning, stacklevel=2)
        return HostMemory(found, {}, "JAX's backends had started")
    applied = {}
    for name, (param, value) in MALLOPT.items():
        if libc.mallopt(ctypes.c_int(param), ctypes.c_int(value)) != 1:   # mallopt returns 1 on success
            raise OSError(f"glibc mallopt({name}, {value}) failed")
        applied[name] = value
    return HostMemory(found, applied)


__all__ = ["ENVIRONMENT", "HostMemory", "MALLOPT", "reuse_host_memory"]
