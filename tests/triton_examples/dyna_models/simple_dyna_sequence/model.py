"""Triton's "simple_dyna_sequence" as the client examples' ``-d`` modes check
it, computed from the sequence control tensors poolserve fills in (never from
the request's parameters): OUTPUT is INPUT plus START (1 on a sequence's first
request), plus CORRID on its END request; READY 0 would answer zeros. OUTPUT
is INT32: a UINT64 CORRID past 32 bits adds its low 32 bits (wrapping, as
int32 arithmetic does).

(Triton's dyna_sequence backend accumulates instead, as
simple_string_dyna_sequence does; the examples check the int model's outputs
request by request, 1, 11, 7, ..., which an accumulator would not give.)
"""

import numpy as np

from poolserve.service import Model


def flag(tensor):
    return bool(np.asarray(tensor).reshape(-1)[0])


class StartPlusInputPlusEndCorrid(Model):
    def predict(self, inputs, parameters):
        if not flag(inputs["READY"]):
            return {"OUTPUT": np.zeros_like(inputs["INPUT"])}
        value = inputs["INPUT"].astype(np.int64) + int(flag(inputs["START"]))
        if flag(inputs["END"]):
            value += int(np.asarray(inputs["CORRID"]).reshape(-1)[0]) % 2**32
        return {"OUTPUT": value.astype(np.int32)}
