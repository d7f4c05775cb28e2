"""A worker extension that says where a rank's model, cache and weights live: the CUDA tests'
check that a path did not quietly run on the CPU (tests/test_cuda.py). A module of its own, so
that each rank imports only this."""

from __future__ import annotations

import torch

from rankcast.worker.model_runner import ModelRunner


class DeviceReport:
    device: torch.device
    dtype: torch.dtype
    runner: ModelRunner

    def device_report(self) -> dict[str, str]:
        weights = {str(p.device) for p in self.runner.model.parameters() if p.numel()}
        return {
            "device": str(self.device),
            "dtype": str(self.dtype),
            "cache": str(self.runner.kv_caches[0].device),
            "weights": ",".join(sorted(weights)),
        }
