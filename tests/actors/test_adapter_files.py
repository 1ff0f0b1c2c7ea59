"""Where the vLLM engine writes adapters (actors/adapter_files.py): tmpfs when the version fits,
disk when it does not, checked on a real 2 MiB tmpfs mounted in a mount namespace of its own
(`unshare`, as a container's small /dev/shm)."""

import json
import shutil
import subprocess
import sys

import pytest

_SCRIPT = r"""
import json, logging, subprocess, sys
import torch
from actors.adapter_files import AdapterFiles
from policy.adapter import read_adapter
from policy.load import LoraSpec

shm, disk = sys.argv[1], sys.argv[2]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", shm], check=True)
logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="LOG %(message)s")

def adapter(width):  # one q_proj LoRA pair of rank 8: 2 x 8 x width float32
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    return {f"{name}.lora_A.weight": torch.ones(8, width), f"{name}.lora_B.weight": torch.zeros(width, 8)}

spec = LoraSpec(rank=8, alpha=16, target_modules=["q_proj"])
files = AdapterFiles(fast=shm, slow=disk)
small = files.write(1, adapter(1024), spec, "base")          # 64 KiB: fits in the 2 MiB tmpfs
large = files.write(2, adapter(65536), spec, "base")         # 4 MiB: does not
after = files.fell_back
files.remove(large)
again = files.write(3, adapter(1024), spec, "base")          # small again: back in tmpfs
back = read_adapter(large.parent / "v2") if (large.parent / "v2").exists() else None
print(json.dumps({"small": str(small), "large": str(large), "again": str(again), "why": after,
                  "version": read_adapter(small).version, "removed": back is None}))
files.close()
"""


def _unshare() -> list[str] | None:
    """A command prefix that runs in a mount namespace of its own where tmpfs can be mounted."""
    if shutil.which("unshare") is None:
        return None
    cmd = ["unshare", "--user", "--map-root-user", "--mount"]
    probe = subprocess.run([*cmd, "true"], capture_output=True)
    return cmd if probe.returncode == 0 else None


def test_an_adapter_that_does_not_fit_in_a_small_tmpfs_goes_to_disk(tmp_path):
    cmd = _unshare()
    if cmd is None:
        pytest.skip("no unprivileged mount namespace here (unshare) to mount a small tmpfs in")
    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir()
    disk.mkdir()
    out = subprocess.run([*cmd, sys.executable, "-c", _SCRIPT, str(shm), str(disk)], capture_output=True,
                         text=True, timeout=900)  # a hang guard: a loaded machine imports torch slowly
    assert out.returncode == 0, out.stderr[-2000:]
    logged = [line for line in out.stdout.splitlines() if line.startswith("LOG ")]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["small"].startswith(str(shm) + "/tandem-lora-") and result["small"].endswith("/v1")
    assert result["large"].startswith(str(disk) + "/tandem-lora-") and result["large"].endswith("/v2")
    assert result["again"].startswith(str(shm) + "/tandem-lora-") and result["again"].endswith("/v3")
    assert result["why"].endswith("MiB free") and result["version"] == 1 and result["removed"]
    assert len(logged) == 1 and "adapter v2 does not fit in" in logged[0] and "--shm-size" in logged[0], logged
    assert list(disk.iterdir()) == []  # close removed the folder on disk too


def test_without_a_tmpfs_adapters_go_to_disk(tmp_path):
    import torch

    from actors.adapter_files import AdapterFiles
    from policy.load import LoraSpec

    files = AdapterFiles(fast=str(tmp_path / "missing"), slow=str(tmp_path))
    name = "base_model.model.model.layers.0.self_attn.q_proj"
    path = files.write(4, {f"{name}.lora_A.weight": torch.ones(8, 16), f"{name}.lora_B.weight": torch.zeros(16, 8)},
                       LoraSpec(rank=8, alpha=16, target_modules=["q_proj"]), "base")
    assert files.fast is None and path.parent.parent == tmp_path and files.fell_back == "no tmpfs"
    files.close()
    assert not path.exists()
