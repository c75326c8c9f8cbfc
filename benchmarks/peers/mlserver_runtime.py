"""The digits CNN as an MLServer custom runtime, for ``benchmarks/serving.py``: the same model
class and weights as distml's replicas, one thread, inference mode."""

from __future__ import annotations

import torch
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse
from safetensors.torch import load_model

from distml.models import DigitsCNN


class DigitsRuntime(MLModel):
    async def load(self) -> bool:
        torch.set_num_threads(1)
        self.model = DigitsCNN().eval()
        load_model(self.model, self.settings.parameters.uri)
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = torch.from_numpy(NumpyCodec.decode_input(payload.inputs[0]))
        with torch.inference_mode():
            y = self.model(x).numpy()
        return InferenceResponse(
            model_name=self.name, outputs=[NumpyCodec.encode_output("logits", y)]
        )
