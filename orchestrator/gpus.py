"""How many GPUs this process can use, asked of torch only where one can be there at all.

The launchers (`run`/`resume`, a trainer pod's `workers` role) count GPUs before anything starts,
and nothing else in their processes needs torch: the workers import it in their own processes.
Importing it for the count was 2.5 s of every `run` and of every trainer pod's start on a CPU
machine.
"""

from __future__ import annotations

import os
import sys

# What a GPU runtime opens first: NVIDIA's control device, WSL's GPU device, ROCm's kernel driver.
# A process that can open none of them sees no GPU, whatever torch would say.
GPU_DRIVER_NODES = ("/dev/nvidiactl", "/dev/dxg", "/dev/kfd")


def cuda_device_count() -> int:
    """torch.cuda.device_count(); 0 without importing torch where no GPU driver can be opened
    (torch imported already: it is asked, which costs nothing)."""
    if "torch" not in sys.modules and not any(map(os.path.exists, GPU_DRIVER_NODES)):
        return 0
    import torch

    return torch.cuda.device_count()
