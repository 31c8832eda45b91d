"""A stand-in of Triton's "inception_graphdef" (the shapes and names of grpc_client.py):
1001 class scores per NHWC image, peaked at the image's mean value."""

import numpy as np

from poolserve.service import Model

CLASSES = np.arange(1001, dtype=np.float64)


class Softmax(Model):
    def predict(self, inputs, parameters):
        images = inputs["input"]
        centres = np.floor(images.reshape(len(images), -1).mean(axis=1, dtype=np.float64)) % 1001
        logits = -((CLASSES[None, :] - centres[:, None]) ** 2)
        scores = np.exp(logits - logits.max(axis=1, keepdims=True))
        out = (scores / scores.sum(axis=1, keepdims=True)).astype(np.float32)
        return {"InceptionV3/Predictions/Softmax": out}
