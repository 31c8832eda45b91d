"""An MLServer custom runtime, written for MLServer and served by poolserve as is.

`mlserver start examples/mlserver/wordcount` and `poolserve serve
examples/mlserver/wordcount` both serve it (docs/migrating-from-mlserver.md):
the number of words in each string of ``text``. ``decode_args`` decodes the
inputs with MLServer's codecs (``text`` with StringCodec, as its content type
says) and encodes the returned array with NumpyCodec, as ``output-0``.
``parameters.extra`` reaches the model as ``self.settings.parameters.extra``.
"""

from typing import List  # noqa: UP035 - decode_args knows List[str], not list[str]

import numpy as np
from mlserver import MLModel
from mlserver.codecs import decode_args
from mlserver.errors import InferenceError


class WordCount(MLModel):
    async def load(self) -> bool:
        extra = self.settings.parameters.extra if self.settings.parameters else {}
        self.lowercase = bool((extra or {}).get("lowercase", False))
        return True

    @decode_args
    async def predict(self, text: List[str]) -> np.ndarray:  # noqa: UP006
        if not text:
            raise InferenceError("text is empty: send at least one string")
        if self.lowercase:
            text = [t.lower() for t in text]
        return np.array([[len(t.split())] for t in text], dtype=np.int64)
