"""A stand-in of Triton's "preprocess_inception_ensemble" (ensemble_image_client.py):
one model that takes encoded image files (BYTES, one per batch row), decodes
them (Pillow) and scores 1001 classes, peaked at the image's mean pixel value.
Triton runs it as an ensemble of a DALI preprocessing model and Inception."""

import io

import numpy as np
from PIL import Image, UnidentifiedImageError

from poolserve.service import InvalidInput, Model

CLASSES = np.arange(1001, dtype=np.float64)


def mean_value(encoded):
    try:
        with Image.open(io.BytesIO(encoded)) as image:
            return float(np.asarray(image.convert("RGB"), dtype=np.float64).mean())
    except (UnidentifiedImageError, OSError) as exc:
        raise InvalidInput(f"not an image file: {exc}") from None


class EncodedImageClassifier(Model):
    def example(self):
        buffer = io.BytesIO()
        Image.new("RGB", (8, 8), (7, 7, 7)).save(buffer, format="PNG")
        return {"INPUT": np.array([[buffer.getvalue()]], dtype=object)}

    def predict(self, inputs, parameters):
        files = inputs["INPUT"].reshape(len(inputs["INPUT"]), -1)[:, 0]
        centres = np.array([np.floor(mean_value(bytes(f))) for f in files])
        logits = -((CLASSES[None, :] - centres[:, None]) ** 2)
        scores = np.exp(logits - logits.max(axis=1, keepdims=True))
        return {"OUTPUT": (scores / scores.sum(axis=1, keepdims=True)).astype(np.float32)}
