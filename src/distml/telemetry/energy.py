"""Energy per step: measured from hardware counters where they exist, otherwise estimated.

Sources, in order of preference:

- ``measured:nvml``: the GPU's total-energy counter (NVML, Volta and newer), one per device.
- ``measured:rapl``: the CPU package counter under /sys/class/powercap (Intel RAPL, also exposed
  for AMD Zen). A package is shared by the processes on a node, so only local rank 0 reads it.
- ``estimated:cpu-time``: joules = CPU seconds of this process (all its threads) x watts per busy
  core. The default of 10 W per core is a typical server figure (a 2-socket, 64-core part with a
  ~300 W package power spends ~5 W per core at full load, desktop parts 10-20 W); set it with
  ``telemetry.watts_per_cpu_core``. Idle and uncore power are not counted.
"""

from __future__ import annotations

import glob
import time
from pathlib import Path

# pynvml is optional: imported only where a GPU may hold an energy counter.


class EnergyMeter:
    """A cumulative joule counter; ``source`` says how the number is obtained."""

    source: str

    def read(self) -> float:
        raise NotImplementedError


class CpuTimeEstimate(EnergyMeter):
    def __init__(self, watts_per_core: float):
        self.watts = watts_per_core
        self.source = f"estimated:cpu-time x {watts_per_core:g} W/core"

    def read(self) -> float:
        return time.process_time() * self.watts


class RaplCounter(EnergyMeter):
    source = "measured:rapl"

    def __init__(self, files: list[Path], reads: bool):
        self.files = files
        self.reads = reads  # False on every local rank but 0: the package is shared
        self._max = [float((f.parent / "max_energy_range_uj").read_text()) for f in files]
        self._last = [self._raw(i) for i in range(len(files))]
        self._total = 0.0

    def _raw(self, i: int) -> float:
        return float(self.files[i].read_text())

    def read(self) -> float:
        if not self.reads:
            return 0.0
        for i in range(len(self.files)):
            now = self._raw(i)
            delta = now - self._last[i]
            if delta < 0:  # the counter wrapped
                delta += self._max[i]
            self._total += delta / 1e6
            self._last[i] = now
        return self._total


class NvmlCounter(EnergyMeter):
    source = "measured:nvml"

    def __init__(self, device_index: int):
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        self._start = self._mj()

    def _mj(self) -> int:
        return self._nvml.nvmlDeviceGetTotalEnergyConsumption(self._handle)

    def read(self) -> float:
        return (self._mj() - self._start) / 1e3


def _rapl_files() -> list[Path]:
    files = [Path(p) for p in sorted(glob.glob("/sys/class/powercap/intel-rapl:[0-9]*/energy_uj"))]
    try:
        for f in files:
            float(f.read_text())
    except OSError:
        return []
    return files


def open_energy_meter(
    device_type: str, device_index: int, local_rank: int, watts_per_core: float
) -> EnergyMeter:
    if device_type == "cuda":
        try:
            return NvmlCounter(device_index)
        except Exception:  # pynvml absent, or the GPU has no energy counter
            pass
    files = _rapl_files()
    if files:
        return RaplCounter(files, reads=local_rank == 0)
    return CpuTimeEstimate(watts_per_core)
