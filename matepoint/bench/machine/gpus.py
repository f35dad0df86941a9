"""The GPUs this process sees and the driver, for ``python -m matepoint``,
without creating a CUDA context (which would take GPU memory, and seconds
on a machine of eight GPUs): NVIDIA's management library (NVML, the one
nvidia-smi reads) through ctypes, else torch's device count, which asks
the CUDA runtime for the count alone.

NVML lists every GPU of the machine; CUDA_VISIBLE_DEVICES, when set, names
the ones this process uses (by index or UUID), and only those are listed."""
from __future__ import annotations

import ctypes
import os
from typing import Any, Dict, List, Optional

import torch

_NAME_BYTES = 96
_VERSION_BYTES = 80
# NVML's library, as the driver installs it (a module attribute: a test
# loads a stand-in)
NVML_LIBRARY = "libnvidia-ml.so.1"


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


def _text(function: Any, handle: Any, size: int) -> Optional[str]:
    buffer = ctypes.create_string_buffer(size)
    arguments = (handle, buffer, size) if handle is not None else (buffer, size)
    if function(*arguments) != 0:
        return None
    return buffer.value.decode(errors="replace")


def _visible(index: int, uuid: Optional[str]) -> Optional[int]:
    """GPU ``index`` (NVML's order)'s place among those CUDA_VISIBLE_DEVICES
    lets this process use (by index or UUID prefix), which is the index
    torch gives it; None where it is not one of them."""
    chosen = os.environ.get("CUDA_VISIBLE_DEVICES")
    if chosen is None:
        return index
    for place, item in enumerate(part.strip() for part in chosen.split(",")):
        if item == str(index) or (uuid is not None and item and uuid.startswith(item)):
            return place
    return None


def _nvml_devices() -> Optional[Dict[str, Any]]:
    """{"driver": ..., "gpus": [...]} from NVML, or None without it."""
    try:
        nvml = ctypes.CDLL(NVML_LIBRARY)
    except OSError:
        return None
    if nvml.nvmlInit_v2() != 0:
        return None
    try:
        count = ctypes.c_uint(0)
        if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
            return None
        gpus: List[Dict[str, Any]] = []
        for index in range(count.value):
            handle = ctypes.c_void_p()
            if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
                continue
            uuid = _text(nvml.nvmlDeviceGetUUID, handle, _NAME_BYTES)
            place = _visible(index, uuid)
            if place is None:
                continue
            memory = _Memory()
            total = (memory.total if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory))
                     == 0 else None)
            gpus.append({"index": place, "name": _text(nvml.nvmlDeviceGetName, handle,
                                                       _NAME_BYTES),
                         "memory_total_bytes": total, "uuid": uuid})
        return {"driver": _text(nvml.nvmlSystemGetDriverVersion, None, _VERSION_BYTES),
                "gpus": sorted(gpus, key=lambda gpu: gpu["index"]), "source": "NVML"}
    finally:
        nvml.nvmlShutdown()


def devices() -> Dict[str, Any]:
    """The driver's version (None: unknown) and the GPUs seen: index (as
    torch numbers them), name, total memory, UUID; and where it was read."""
    found = _nvml_devices()
    if found is not None:
        return found
    count = torch.cuda.device_count() if torch.version.cuda is not None else 0
    return {"driver": None, "source": "torch.cuda.device_count()",
            "gpus": [{"index": index, "name": None, "memory_total_bytes": None, "uuid": None}
                     for index in range(count)]}
