"""GPU utilisation, memory and PCIe traffic from NVML, for ``/metrics``, where NVML is present.

NVML (``libnvidia-ml``, installed with the NVIDIA driver; Python bindings from
the ``nvidia-ml-py`` package of the ``cuda`` extra) reports what the CUDA
driver does not: how busy the GPU is and how many bytes cross PCIe each
second, which with the stage histograms give the device's utilisation and
how well the host-to-device copies use the link. Without the bindings or a
driver, this collector reports nothing (DCGM's exporter, in the compose
stack's ``gpu`` profile, covers the whole host either way).

The GPUs reported are those ``CUDA_VISIBLE_DEVICES`` names (indices, taken as
NVML's, which match CUDA's with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; or
``GPU-`` UUIDs), else every GPU NVML sees.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import structlog
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

log = structlog.get_logger("dicom_ingest.nvml")


class NvmlCollector(Collector):
    """Reads NVML at each scrape; initialises it on the first and gives up for good on failure."""

    def __init__(self) -> None:
        self._nvml: Any = None
        self._handles: list[tuple[str, Any]] | None = None  # (uuid, handle)

    def _open(self) -> list[tuple[str, Any]]:
        if self._handles is not None:
            return self._handles
        self._handles = []
        try:
            import pynvml

            pynvml.nvmlInit()
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            if visible is None:
                names: list[str] = [str(i) for i in range(pynvml.nvmlDeviceGetCount())]
            else:
                names = [v.strip() for v in visible.split(",") if v.strip()]
            for name in names:
                if name.startswith("GPU-"):
                    handle = pynvml.nvmlDeviceGetHandleByUUID(name)
                else:
                    handle = pynvml.nvmlDeviceGetHandleByIndex(int(name))
                uuid = pynvml.nvmlDeviceGetUUID(handle)
                self._handles.append((uuid if isinstance(uuid, str) else uuid.decode(), handle))
            self._nvml = pynvml
        except Exception as exc:  # no bindings, no driver, no GPU: nothing to report
            log.debug("NVML unavailable", error=type(exc).__name__)
            self._handles = []
        return self._handles

    def describe(self) -> Iterable[Metric]:
        """What registering asks for: the names, without touching NVML (it opens on a scrape,
        after the worker set ``CUDA_VISIBLE_DEVICES``)."""
        return families()

    def collect(self) -> Iterable[Metric]:
        handles = self._open()
        if not handles:
            return []
        nvml = self._nvml
        util, used, total, rx = found = families()
        for uuid, handle in handles:
            try:
                rates = nvml.nvmlDeviceGetUtilizationRates(handle)
                memory = nvml.nvmlDeviceGetMemoryInfo(handle)
                kbps = nvml.nvmlDeviceGetPcieThroughput(handle, nvml.NVML_PCIE_UTIL_RX_BYTES)
            except Exception as exc:  # a GPU fallen off the bus must not break the scrape
                log.warning("NVML read failed", gpu=uuid, error=type(exc).__name__)
                continue
            util.add_metric([uuid], rates.gpu / 100.0)
            used.add_metric([uuid], memory.used)
            total.add_metric([uuid], memory.total)
            rx.add_metric([uuid], kbps * 1024.0)
        return found


def families() -> list[GaugeMetricFamily]:
    """The (empty) families this collector fills: utilisation, memory used and total, PCIe."""
    return [
        GaugeMetricFamily(
            "dicom_ingest_gpu_utilization_ratio",
            "Fraction of the last sample period a kernel ran on the GPU (NVML)",
            labels=["gpu"],
        ),
        GaugeMetricFamily(
            "dicom_ingest_gpu_memory_used_bytes",
            "GPU memory in use, all processes (NVML)",
            labels=["gpu"],
        ),
        GaugeMetricFamily(
            "dicom_ingest_gpu_memory_total_bytes", "GPU memory (NVML)", labels=["gpu"]
        ),
        GaugeMetricFamily(
            "dicom_ingest_gpu_pcie_rx_bytes_per_second",
            "Bytes/s the GPU receives over PCIe (host to device), NVML's ~20 ms sample",
            labels=["gpu"],
        ),
    ]
