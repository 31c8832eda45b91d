"""MLServer's streaming example (docs/examples/streaming), written anew for
poolserve's side-by-side tests: ``text-model`` streams its prompt back a word
at a time (each word after the first with the space before it), one
InferenceResponse per word from ``predict_stream``, with no ``predict`` of
its own. The example waits half a second per word to look like a slow
model; this one waits ``PAUSE_S``. `mlserver start examples/mlserver/streaming`
and `poolserve serve examples/mlserver/streaming` stream its README's
requests alike, over gRPC and REST (tests/test_mlserver_readme_examples.py).
"""

import asyncio
from collections.abc import AsyncIterator

from mlserver import MLModel
from mlserver.codecs import StringCodec
from mlserver.types import InferenceRequest, InferenceResponse

PAUSE_S = 0.02


class TextModel(MLModel):
    async def predict_stream(
        self, payloads: AsyncIterator[InferenceRequest]
    ) -> AsyncIterator[InferenceResponse]:
        received = [payload async for payload in payloads]  # all of them, as the example
        prompt = StringCodec.decode_input(received[0].inputs[0])[0]  # the first one's text
        for index, word in enumerate(prompt.split(" ")):
            await asyncio.sleep(PAUSE_S)
            token = word if index == 0 else f" {word}"
            output = StringCodec.encode_output(name="output", payload=[token], use_bytes=True)
            yield InferenceResponse(model_name=self._settings.name, outputs=[output])
