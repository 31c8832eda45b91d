"""repeat_int32: a decoupled model, Triton's repeat backend in Python.

One request, one response per element of IN: response i carries OUT = IN[i]
and IDX = i, sent DELAY[i] milliseconds after the previous one; WAIT
milliseconds pass before the stream ends. An empty IN gets no response at all.
tritonclient's stream API (``start_stream``, ``async_stream_infer``) drives it.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np

from poolserve.service import Array, Model


class RepeatModel(Model):
    def predict_stream(
        self, inputs: dict[str, Array], parameters: dict[str, object]
    ) -> Iterator[dict[str, Array]]:
        values = inputs["IN"].reshape(-1)
        delays = inputs.get("DELAY", np.zeros(len(values), np.uint32)).reshape(-1)
        wait = inputs.get("WAIT", np.zeros(1, np.uint32)).reshape(-1)
        for i, value in enumerate(values):
            if i < len(delays) and delays[i]:
                time.sleep(float(delays[i]) / 1000)
            yield {
                "OUT": np.array([value], dtype=np.int32),
                "IDX": np.array([i], dtype=np.uint32),
            }
        if len(wait) and wait[0]:
            time.sleep(float(wait[0]) / 1000)
