"""One client's side of a secure-aggregation round over HTTP: each stage reads what the stage
before produced (the peers' keys, its inbox of shares, the survivors), then sends its message.
Only the masked vector ``[w * delta, w]`` leaves the client (see
:mod:`distml.federated.secure_round`).
"""

from __future__ import annotations

import json
import logging
from typing import Any

import torch

from distml.federated.secagg import SecAggClient, SecAggError, SecAggParams
from distml.federated.task import flatten
from distml.net import ServiceError, encode_tensors

log = logging.getLogger(__name__)
TOO_EARLY = 425
LEFT_OUT = {403, 409}


class SecureSession:
    def __init__(self, client, task: dict[str, Any]):
        self.client = client
        self.task = task
        info = task["secagg"]
        self.weight_scale = info["weight_scale"]
        self.protocol = SecAggClient(int(info["id"]), SecAggParams(**info["params"]))
        self.active = True

    def step(self, stage: str) -> None:
        if not self.active:
            return
        try:
            message = self._message(stage)
            if stage == "masked_input":
                # Ring values travel as the int32 of the same bits: half the bytes of int64.
                wire = torch.where(message >= 2**31, message - 2**32, message).to(torch.int32)
                self._post(stage, content=encode_tensors({"masked": wire}))
            else:
                self._post(stage, content=json.dumps(message).encode())
        except (SecAggError, ValueError) as exc:
            # The protocol says stop, or a peer's (or the server's) material is bad: sitting out
            # is the safe answer, and the others go on without this client.
            log.warning("secure aggregation, %s: %s", stage, exc)
            self.active = False
        except ServiceError as exc:
            if exc.status not in LEFT_OUT:
                raise
            self.active = False

    def _message(self, stage: str) -> Any:
        if stage == "advertise":
            return self.protocol.advertise()
        view = self._view(stage)
        if stage == "share_keys":
            return self.protocol.share_keys(view)
        if stage == "unmask":
            return self.protocol.unmask(view)
        delta, examples, _ = self.client.train(self.task)
        weight = 1.0 if self.weight_scale is None else min(1.0, examples / self.weight_scale)
        vector = torch.cat([flatten(delta).double() * weight, torch.tensor([weight])])
        return self.protocol.masked_input(vector.float(), view)

    def _view(self, stage: str) -> Any:
        while True:
            try:
                return self.client.http.request(
                    "GET", f"/v1/secagg/{stage}", params={"round": self.task["round"], "wait": 20}
                ).json()
            except ServiceError as exc:
                if exc.status != TOO_EARLY:
                    raise

    def _post(self, stage: str, content: bytes) -> None:
        self.client.http.request(
            "POST", f"/v1/secagg/{stage}", params={"round": self.task["round"]}, content=content
        )
