"""Mixed precision for a step: autocast around the forward, and loss scaling under fp16.

bf16 keeps fp32's exponent range and needs no scaling; fp16 does not, so small gradients would
flush to zero without a scaler (Micikevicius et al. 2018). fp16 autocast exists on CUDA only.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from distml.config import Precision

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class MixedPrecision:
    """The run's ``strategy.mixed_precision`` on ``device``.

    ``autocast=False`` where something else casts (FSDP's mixed-precision policy casts the
    parameters itself); ``scale_loss=False`` where the update does not go through
    :meth:`step` (a layout steps its own optimizer).

    >>> p = MixedPrecision("bf16", torch.device("cpu"))
    >>> with p.autocast():
    ...     (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    torch.bfloat16
    """

    def __init__(
        self,
        precision: Precision,
        device: torch.device,
        *,
        autocast: bool = True,
        scale_loss: bool = True,
    ):
        if precision == "fp16" and device.type != "cuda":
            raise ValueError("fp16 mixed precision needs a CUDA device; use bf16 on the CPU")
        self.precision = precision
        self.device = device
        self.dtype = _DTYPES[precision] if autocast else None
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" and scale_loss else None

    def autocast(self) -> AbstractContextManager[object]:
        if self.dtype is None:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
