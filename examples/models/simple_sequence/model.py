"""simple_sequence: a sequence model, the running sum of Triton's sequence examples.

Each request of a sequence (parameter ``sequence_id``) adds its INPUT to the
sequence's sum and answers the sum so far; ``sequence_start`` starts from 0.
The sums live in the worker that runs the sequence: poolserve sends all of a
sequence's requests there, in order, and calls :meth:`sequence_ended` when it
ends or idles past its timeout.
"""

from __future__ import annotations

import numpy as np

from poolserve.service import Array, Model


class RunningSum(Model):
    def load(self) -> None:
        self.sums: dict[object, int] = {}

    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        value = int(inputs["INPUT"].sum())
        sequence = parameters.get("sequence_id")
        if sequence is None:  # the warm-up prediction: no sequence
            return {"OUTPUT": np.array([[value]], dtype=np.int32)}
        if parameters.get("sequence_start"):
            self.sums[sequence] = 0
        self.sums[sequence] = total = self.sums.get(sequence, 0) + value
        return {"OUTPUT": np.array([[total]], dtype=np.int32)}

    def sequence_ended(self, sequence_id: int | str, reason: str) -> None:
        self.sums.pop(sequence_id, None)
