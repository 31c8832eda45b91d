"""echo: returns each input INPUT<k> as OUTPUT<k>, unchanged (pure serving overhead)."""

from __future__ import annotations

from poolserve.service import Array, InvalidInput, Model


class EchoModel(Model):
    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        outputs = {}
        for name, value in inputs.items():
            if not name.startswith("INPUT"):
                raise InvalidInput(f"echo expects inputs named INPUT<k>, got {name!r}")
            outputs["OUTPUT" + name[len("INPUT") :]] = value
        return outputs
