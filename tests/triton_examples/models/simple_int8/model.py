"""Triton's "simple" model: the sum and the difference of two tensors."""

from poolserve.service import InvalidInput, Model


class AddSub(Model):
    def predict(self, inputs, parameters):
        a, b = inputs["INPUT0"], inputs["INPUT1"]
        if a.shape != b.shape:
            raise InvalidInput(f"INPUT0 {a.shape} and INPUT1 {b.shape} differ")
        return {"OUTPUT0": a + b, "OUTPUT1": a - b}
