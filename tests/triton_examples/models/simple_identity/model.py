"""Triton's "simple_identity": OUTPUT0 is INPUT0."""

from poolserve.service import Model


class Identity(Model):
    def predict(self, inputs, parameters):
        return {"OUTPUT0": inputs["INPUT0"]}
