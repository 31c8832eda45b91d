"""scale: one model in numbered versions; each multiplies INPUT0 by the factor
in its own version folder's ``scale.txt`` and says which version it is.

``model.py`` lives beside ``model-settings.json``, once for every version;
each version loads from its folder (``self.settings.folder`` is ``scale/N``).
The request parameter ``sleep_ms`` (default 0) makes a call take longer.
"""

from __future__ import annotations

import time

import numpy as np

from poolserve.service import Array, InvalidInput, Model


class ScaleModel(Model):
    def load(self) -> None:
        self.factor = np.float32((self.settings.folder / "scale.txt").read_text().strip())
        self.version = np.array([int(self.settings.version)], np.int64)

    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        if "INPUT0" not in inputs:
            raise InvalidInput("expected an input named INPUT0")
        sleep_ms = parameters.get("sleep_ms", 0)
        if not isinstance(sleep_ms, int) or isinstance(sleep_ms, bool) or sleep_ms < 0:
            raise InvalidInput(f"parameter sleep_ms must be a non-negative int64, got {sleep_ms!r}")
        time.sleep(sleep_ms / 1000)
        return {"OUTPUT0": inputs["INPUT0"] * self.factor, "VERSION": self.version}
