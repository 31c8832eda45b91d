"""Triton's "simple_string" model: numbers written as strings, added and subtracted."""

import numpy as np

from poolserve.service import InvalidInput, Model


def numbers(array):
    try:
        return np.array([int(item) for item in array.ravel()], np.int64).reshape(array.shape)
    except ValueError as exc:
        raise InvalidInput(f"not a decimal integer: {exc}") from None


def strings(array):
    return np.array([str(n).encode() for n in array.ravel()], object).reshape(array.shape)


class AddSubStrings(Model):
    def predict(self, inputs, parameters):
        a, b = numbers(inputs["INPUT0"]), numbers(inputs["INPUT1"])
        return {"OUTPUT0": strings(a + b), "OUTPUT1": strings(a - b)}
