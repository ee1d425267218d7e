"""A background thread that records peak memory while a stage runs.

`torch.cuda.max_memory_allocated/reserved` are the exact allocator peaks and are the authority for GPU
numbers; the thread adds what the allocator cannot see: what the process holds on the card
(`slimtune.memory.device_usage`: the CUDA context, library workspaces, NCCL buffers) and host RSS
(offloaded activations, pinned buffers, loader copies). One sample is a /proc read plus, on CUDA, two
allocator counters and one NVML query: 67 us measured on a loaded 2-core CPU machine, 0.13% of the 50 ms
interval. On an H200 the NVML query made one sample cost ~0.7 ms (1.45% of a 3 s stage at 50 ms), so the
wait between samples stretches to at least 200x the last sample's cost, which bounds the sampler to 0.5%
of the task's time; `overhead` reports the measured fraction per run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Self

import psutil
import torch

from slimtune.memory.device_usage import device_reader, process_reader

# Wait at least this many times the last sample's cost, so sampling stays under 1 / 200 = 0.5% of wall time.
_COST_FACTOR = 200


def _device_used_reader(device: torch.device) -> Callable[[], int] | None:
    """A callable giving what this process holds on the device (NVML, per process), or the device's whole
    used memory where NVML cannot tell this process apart; None without a CUDA device."""
    process, whole = process_reader(device), device_reader(device)
    if whole is None:
        return None
    if process is None:
        return whole
    return lambda: (lambda mine: whole() if mine is None else mine)(process())


class PeakSampler:
    """Context manager sampling host RSS, torch allocator and NVML usage every `interval_s` seconds."""

    def __init__(self, device: str, interval_s: float = 0.05) -> None:
        self.device = torch.device(device)
        self.interval_s = interval_s
        self._cuda = self.device.type == "cuda" and torch.cuda.is_available()
        self._device_used = _device_used_reader(self.device)
        self._process = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.peak_host_rss = 0
        # RSS less file-backed and shared pages (mapped safetensors, a mapped GGUF): what the host must hold.
        self.peak_host_anon = 0
        self.peak_gpu_allocated: int | None = 0 if self._cuda else None
        self.peak_gpu_reserved: int | None = 0 if self._cuda else None
        self.peak_device_used: int | None = 0 if self._device_used else None
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
        if self._device_used is not None:
            self.peak_device_used = max(self.peak_device_used or 0, self._device_used())
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
