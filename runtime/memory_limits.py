"""How much memory this process may still take: the host's available memory, or less where a
container's cgroup limit leaves less (psutil reads the host's /proc/meminfo, which a container
sees whole: a build or a KV pool that "fit" there was OOM-killed without a word). Used to refuse
what cannot fit before the work starts, with a message, and to give freed memory back."""

import ctypes
from pathlib import Path

import psutil

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def available_bytes() -> int:
    """psutil's available memory, capped by the cgroup's limit less its usage (v2, or v1)."""
    available = psutil.virtual_memory().available
    for limit, usage in _cgroup_files():
        try:
            text = limit.read_text().strip()
            if text == "max":  # v2: no limit
                continue
            cap = int(text)
            room = cap - int(usage.read_text().strip())
        except (OSError, ValueError):
            continue
        if cap < 1 << 60:  # v1 writes "no limit" as a huge number
            available = min(available, max(room, 0))
    return available


def _cgroup_files() -> list[tuple[Path, Path]]:
    """(limit, usage) files of this process's cgroup: v2's by /proc/self/cgroup's path, then v1's."""
    files = []
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)  # "0::/path" (v2), "4:memory:/path" (v1)
            if controllers == "":
                folder = _CGROUP_ROOT / path.lstrip("/")
                files.append((folder / "memory.max", folder / "memory.current"))
            elif "memory" in controllers.split(","):
                folder = _CGROUP_ROOT / "memory" / path.lstrip("/")
                files.append((folder / "memory.limit_in_bytes", folder / "memory.usage_in_bytes"))
    except OSError:
        pass
    files.append((_CGROUP_ROOT / "memory.max", _CGROUP_ROOT / "memory.current"))  # a container's own root
    files.append((_CGROUP_ROOT / "memory" / "memory.limit_in_bytes", _CGROUP_ROOT / "memory" / "memory.usage_in_bytes"))
    return list(dict.fromkeys(files))


def release_freed_memory() -> None:
    """Give the heap's free pages back to the OS (glibc's malloc_trim): loading leaves ~200 MB of
    freed temporaries that glibc would otherwise keep. A no-op without glibc."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
