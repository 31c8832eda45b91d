"""Triton's "simple_sequence" as its sequence examples check it: OUTPUT is
INPUT plus the sequence's START flag (1 on a sequence's first request, else 0).

Triton's model reads START from a control tensor; poolserve gives the flag to
the model as the ``sequence_start`` parameter.
"""

import numpy as np

from poolserve.service import Model


class StartPlusInput(Model):
    def predict(self, inputs, parameters):
        start = 1 if parameters.get("sequence_start") else 0
        return {"OUTPUT": (inputs["INPUT"] + start).astype(np.int32)}
