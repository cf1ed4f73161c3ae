"""A worker's memory budget: parsed from a flag (``2GiB``, ``500MB``, ``1048576``, ``0.5`` = half the device's
memory), the device's total memory, and the honest size of a loaded handler. No torch import here: a CPU worker
of ``echo`` parses its budget without it, and a handler's modules are recognised by what they offer.

Sizes, best first (``handler_bytes``):

1. the handler's own ``memory_bytes`` (an int attribute or a method returning one): the model's author knows best;
2. the parameters and buffers of every torch module the handler holds as an attribute (``handler.model``),
   counted once each by storage address: the weights, which is what replicas share and a budget is about;
3. else the growth of the process's resident memory across the load (``resident_bytes`` before and after), which
   the pool measures with its loads one at a time so that one load's growth is not another's.
"""

from __future__ import annotations

import os
import re
from typing import Any

from fleet.errors import ConfigError

UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_CUDA_RE = re.compile(r"^cuda(?::(\d+))?$")


def parse_budget(text: str, flag: str = "--memory-budget") -> int | float:
    """Bytes (an ``int``: ``2GiB``, ``500MB``, ``1048576``) or a fraction of the device's memory (a ``float`` in
    (0, 1]: ``0.5``).

    Raises:
        ConfigError: one line naming ``flag`` and the value.
    """
    match = _SIZE_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in UNITS:
        raise ConfigError(
            f"{flag} {text!r} is not a size: write bytes (1073741824), a size with a unit (2GiB, 500MB; units "
            f"{', '.join(u for u in UNITS if u)}) or a fraction of the device's memory (0.5)"
        )
    number = match.group(1)
    if "." in number and not unit:
        fraction = float(number)
        if not 0 < fraction <= 1:
            raise ConfigError(f"{flag} {text!r}: a fraction of the device's memory is in (0, 1]")
        return fraction
    size = int(float(number) * UNITS[unit])
    if size <= 0:
        raise ConfigError(f"{flag} {text!r}: a budget must be more than 0 bytes")
    return size


def budget_bytes(budget: int | float, device: str) -> int:
    """The budget in bytes: bytes as given, a fraction of ``device_memory_bytes(device)``."""
    if isinstance(budget, float):
        return int(budget * device_memory_bytes(device))
    return budget


def device_memory_bytes(device: str) -> int:
    """The device's total memory: the machine's RAM for ``cpu``, the GPU's for ``cuda[:N]``."""
    match = _CUDA_RE.match(device)
    if match is None:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    import torch

    index = int(match.group(1) or 0)
    return int(torch.cuda.get_device_properties(index).total_memory)


def format_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover  (the loop returns)


def resident_bytes() -> int | None:
    """The process's resident memory now (Linux ``/proc/self/statm``); None where it cannot be read."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def declared_bytes(handler: Any) -> int | None:
    """The handler's own ``memory_bytes`` (attribute or method), when it declares a positive int."""
    declared = getattr(handler, "memory_bytes", None)
    if callable(declared):
        declared = declared()
    return declared if isinstance(declared, int) and not isinstance(declared, bool) and declared > 0 else None


def module_bytes(handler: Any) -> int | None:
    """Parameter and buffer bytes of the torch modules among the handler's attributes (each tensor once); None when
    it holds none."""
    seen: set[int] = set()
    total = 0
    found = False
    for value in getattr(handler, "__dict__", {}).values():
        parameters, buffers = getattr(value, "parameters", None), getattr(value, "buffers", None)
        if not (callable(parameters) and callable(buffers) and hasattr(value, "state_dict")):
            continue
        found = True
        for tensor in (*parameters(), *buffers()):
            address = tensor.data_ptr()
            if address in seen:
                continue
            seen.add(address)
            total += tensor.numel() * tensor.element_size()
    return total if found else None


def handler_bytes(handler: Any, resident_growth: int | None) -> int:
    """What the loaded ``handler`` costs the budget (see the module docstring); 0 when nothing could be measured."""
    for size in (declared_bytes(handler), module_bytes(handler)):
        if size is not None:
            return size
    return max(0, resident_growth or 0)
