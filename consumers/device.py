"""Choose the torch device a worker runs its models on, and the precision that goes with it.

``torch`` is imported inside the functions so that a worker serving only ``echo`` or ``sleep`` does not pay for it.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from fleet.errors import ConfigError

if TYPE_CHECKING:
    import torch

_CUDA_RE = re.compile(r"^cuda(?::(\d+))?$")


def resolve_device(pref: str = "auto") -> str:
    """Turn a device preference into a concrete torch device string.

    Args:
        pref: ``auto`` (CUDA where available, else CPU), ``cpu``, ``cuda`` or ``cuda:N``.

    Returns:
        ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        ConfigError: CUDA was asked for but is not available, ``N`` is not a visible GPU, or ``pref`` is none of
            the above.
    """
    pref = pref.strip().lower()
    if pref == "cpu":
        return "cpu"  # no torch import: a CPU worker of a model without torch stays light
    match = _CUDA_RE.match(pref)
    if pref != "auto" and match is None:
        raise ConfigError(f"device {pref!r} is not supported; use auto, cpu, cuda or cuda:N")
    import torch

    if pref == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    assert match is not None
    if not torch.cuda.is_available():
        raise ConfigError(
            f"device {pref!r} was asked for but CUDA is not available to torch {torch.__version__} "
            "(no GPU, no driver, or a CPU-only build); use device=auto or device=cpu"
        )
    index = match.group(1)
    if index is not None and int(index) >= torch.cuda.device_count():
        raise ConfigError(f"device {pref!r} does not exist: {torch.cuda.device_count()} CUDA device(s) visible")
    return pref


def is_cuda(device: str) -> bool:
    return device.startswith("cuda")


def torch_dtype_for(device: str) -> torch.dtype:
    """Half precision on CUDA, full precision on CPU (where fp16 matmuls are slow or missing)."""
    import torch

    return torch.float16 if is_cuda(device) else torch.float32
