"""Triton's dyna_sequence backend (server/src/test/dyna_sequence) for
"simple_string_dyna_sequence", computed from the sequence control tensors
poolserve fills in (never from the request's parameters): an INT32
accumulator per correlation ID; START sets it to the sum of INPUT, a later
request adds that sum, END adds CORRID; READY 0 leaves it alone; OUTPUT is the
accumulator. CORRID is BYTES (the string sequence id), decoded into an
integer as the backend requires.
"""

import numpy as np

from poolserve.service import Model


def flag(tensor):
    return bool(np.asarray(tensor).reshape(-1)[0])


class Accumulator(Model):
    def load(self):
        self.sums = {}

    def predict(self, inputs, parameters):
        corrid = int(np.asarray(inputs["CORRID"]).reshape(-1)[0].decode())
        if flag(inputs["READY"]):
            total = int(inputs["INPUT"].sum())
            if flag(inputs["START"]):
                self.sums[corrid] = total
            else:
                self.sums[corrid] = self.sums.get(corrid, 0) + total
            if flag(inputs["END"]):
                self.sums[corrid] += corrid
        value = self.sums.get(corrid, 0)
        return {"OUTPUT": np.full(inputs["INPUT"].shape, value, np.int32)}

    def sequence_ended(self, sequence_id, reason):
        self.sums.pop(int(sequence_id), None)
