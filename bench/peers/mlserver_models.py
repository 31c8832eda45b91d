"""The bench's models as MLServer runtimes (imported through PYTHONPATH=bench/peers).

Written the way MLServer's docs write custom runtimes: NumpyCodec to decode
the input and encode the output. The loop and the counter come from
``workload.py``, the same code every server in the bench runs.
"""

from __future__ import annotations

import numpy as np
import workload
from mlserver import MLModel
from mlserver.codecs import NumpyCodec
from mlserver.types import InferenceRequest, InferenceResponse


def _extra(model: MLModel) -> dict[str, object]:
    params = model.settings.parameters
    extra = params.extra if params is not None else None
    return dict(extra or {})


class EchoRuntime(MLModel):
    async def load(self) -> bool:
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0])
        out = NumpyCodec.encode_output("OUTPUT0", x)
        # perf_analyzer's HTTP client (tritonclient 2.51) fails on an output whose parameters
        # lack binary_data_size; NumpyCodec adds {"content_type": "np"}: drop it (REST part).
        out.parameters = None
        return InferenceResponse(model_name=self.name, outputs=[out])


class BurnRuntime(MLModel):
    async def load(self) -> bool:
        extra = _extra(self)
        self.iterations = int(str(extra["iterations"]))
        self.counter = workload.ExecutionCounter(str(extra.get("counter", "")))
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0])
        workload.burn(self.iterations, self.counter)
        return InferenceResponse(
            model_name=self.name, outputs=[NumpyCodec.encode_output("OUTPUT0", x)]
        )


class BigRuntime(MLModel):
    async def load(self) -> bool:
        count = int(str(_extra(self)["array_mib"])) * 1024 * 1024 // 8
        self.table = np.ones(count, dtype=np.float64)
        return True

    async def predict(self, payload: InferenceRequest) -> InferenceResponse:
        x = NumpyCodec.decode_input(payload.inputs[0])
        y = x + np.float32(self.table[x.size])
        return InferenceResponse(
            model_name=self.name, outputs=[NumpyCodec.encode_output("OUTPUT0", y)]
        )
