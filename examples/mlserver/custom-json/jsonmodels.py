"""MLServer's custom-json example (docs/examples/custom-json), written anew
for poolserve's side-by-side tests: ``json-hello-world`` reads each input as
one JSON document (a BYTES string, decoded with StringCodec unless its
content type says otherwise) and answers them, with a greeting, as one JSON
string in the output ``echo_response``, whose shape is the string's length
in bytes, as the example's model writes it (not its element count: MLServer
lets it be). `mlserver start examples/mlserver/custom-json` and `poolserve
serve examples/mlserver/custom-json` answer its README's requests alike
(tests/test_mlserver_readme_examples.py).
"""

import json
from typing import Any

from mlserver import MLModel, types
from mlserver.codecs import StringCodec

GREETING = "Got your request. Hello from the server."


class JsonHelloWorldModel(MLModel):
    async def load(self) -> bool:
        print("Initialize model")  # the example's one line at load
        return await super().load()

    async def predict(self, payload: types.InferenceRequest) -> types.InferenceResponse:
        documents = {tensor.name: self._document(tensor) for tensor in payload.inputs}
        answer = json.dumps({"request": documents, "server_response": GREETING}).encode()
        echo = types.ResponseOutput(
            name="echo_response",
            shape=[len(answer)],
            datatype="BYTES",
            data=[answer],
            parameters=types.Parameters(content_type="str"),
        )
        return types.InferenceResponse(
            id=payload.id, model_name=self.name, model_version=self.version, outputs=[echo]
        )

    def _document(self, tensor: types.RequestInput) -> Any:
        text = "".join(self.decode(tensor, default_codec=StringCodec))
        return json.loads(text)
