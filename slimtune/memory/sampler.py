"""A background thread that records peak memory while a stage runs.

`torch.cuda.max_memory_allocated/reserved` are the exact allocator peaks and are the authority for
GPU numbers; the thread adds what the allocator cannot see: device-wide used memory from NVML
(other processes, the CUDA context, NCCL buffers) and host RSS (offloaded activations, pinned
buffers, loader copies). One sample is a /proc read plus, on CUDA, two allocator counters and one
NVML query: 67 us measured on a loaded 2-core CPU machine, 0.13% of the 50 ms interval. On an H200
the NVML query made one sample cost ~0.7 ms (1.45% of a 3 s stage at 50 ms), so the wait between samples
stretches to at least 200x the last sample's cost, which bounds the sampler to 0.5% of the task's time;
`overhead` reports the measured fraction per run.
"""

from __future__ import annotations

import threading
import time
from types import TracebackType
from typing import Self

import psutil
import torch

# Wait at least this many times the last sample's cost, so sampling stays under 1 / 200 = 0.5% of wall time.
_COST_FACTOR = 200


def _nvml_reader(device: torch.device):
    """Return a callable giving device-wide used bytes, or None when NVML is unavailable."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    try:
        import pynvml  # nvidia-ml-py; torch.cuda.device_memory_used needs it
    except ImportError:
        # cudaMemGetInfo sees the same device-wide total (context and library workspaces included).
        return lambda: (lambda free, total: total - free)(*torch.cuda.mem_get_info(device))
    try:
        torch.cuda.device_memory_used(device)
    except (pynvml.NVMLError, RuntimeError):  # no usable driver, or a device NVML cannot see
        return None
    return lambda: torch.cuda.device_memory_used(device)


class PeakSampler:
    """Context manager sampling host RSS, torch allocator and NVML usage every `interval_s` seconds."""

    def __init__(self, device: str, interval_s: float = 0.05) -> None:
        self.device = torch.device(device)
        self.interval_s = interval_s
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._nvml = _nvml_reader(self.device)
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak_host_rss = 0
        # RSS less file-backed and shared pages (mapped safetensors, a mapped GGUF): what the host must hold.
        self.peak_host_anon = 0
        self.peak_gpu_allocated: int | None = 0 if self._cuda else None
        self.peak_gpu_reserved: int | None = 0 if self._cuda else None
        self.peak_device_used: int | None = 0 if self._nvml else None
        self.start_host_rss = 0  # host RSS when sampling began: peaks are compared with it
        self.samples = 0
        self.sample_seconds = 0.0
        self._started = 0.0
        self.elapsed = 0.0

    def sample(self) -> None:
        """Take one sample and fold it into the peaks; also timed so overhead can be reported."""
        t0 = time.perf_counter()
        info = self._process.memory_info()
        self.peak_host_rss = max(self.peak_host_rss, info.rss)
        self.peak_host_anon = max(self.peak_host_anon, info.rss - getattr(info, "shared", 0))
        if self._cuda:
            self.peak_gpu_allocated = max(self.peak_gpu_allocated or 0, torch.cuda.memory_allocated(self.device))
            self.peak_gpu_reserved = max(self.peak_gpu_reserved or 0, torch.cuda.memory_reserved(self.device))
        if self._nvml is not None:
            self.peak_device_used = max(self.peak_device_used or 0, self._nvml())
        self.samples += 1
        self.sample_seconds += time.perf_counter() - t0

    @property
    def overhead(self) -> float:
        """Fraction of wall time the sampler thread spent sampling."""
        return self.sample_seconds / self.elapsed if self.elapsed > 0 else 0.0

    def _run(self) -> None:
        last = 0.0
        while not self._stop.wait(max(self.interval_s, _COST_FACTOR * last)):
            before = self.sample_seconds
            self.sample()
            last = self.sample_seconds - before

    def __enter__(self) -> Self:
        self._started = time.perf_counter()
        self.sample()
        self.start_host_rss = self.peak_host_rss
        self._thread = threading.Thread(target=self._run, name="slimtune-memory-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()
        self.elapsed = time.perf_counter() - self._started
        if self._cuda:
            # The allocator's own high-water marks catch spikes shorter than the sampling interval.
            self.peak_gpu_allocated = max(self.peak_gpu_allocated or 0, torch.cuda.max_memory_allocated(self.device))
            self.peak_gpu_reserved = max(self.peak_gpu_reserved or 0, torch.cuda.max_memory_reserved(self.device))
