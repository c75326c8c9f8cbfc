"""The digits CNN behind KServe's Python model server, for ``benchmarks/serving.py``: the same
model class and weights as distml's replicas, one thread, inference mode.

    python kserve_server.py MODEL.safetensors --http_port 8080 [KServe's own flags]
"""

from __future__ import annotations

import sys
import uuid

import kserve
import torch
from kserve import InferRequest, InferResponse
from kserve.protocol.infer_type import InferOutput
from safetensors.torch import load_model

from distml.models import DigitsCNN


class DigitsModel(kserve.Model):
    def __init__(self, weights: str):
        super().__init__("digits-cnn")
        self.weights = weights
        self.load()

    def load(self) -> bool:
        torch.set_num_threads(1)
        self.model = DigitsCNN().eval()
        load_model(self.model, self.weights)
        self.ready = True
        return self.ready

    async def predict(self, payload: InferRequest, headers=None, response_headers=None):
        x = torch.from_numpy(payload.inputs[0].as_numpy())
        with torch.inference_mode():
            y = self.model(x).numpy()
        output = InferOutput("logits", list(y.shape), "FP32")
        output.set_data_from_numpy(y, binary_data=False)
        return InferResponse(payload.id or uuid.uuid4().hex, self.name, [output])


if __name__ == "__main__":
    weights = sys.argv.pop(1)  # KServe's server reads the rest of the command line
    kserve.ModelServer().start([DigitsModel(weights)])
