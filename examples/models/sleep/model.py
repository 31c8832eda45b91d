"""sleep: sleeps the request parameter sleep_ms (default 100), returns INPUT0 as OUTPUT0."""

from __future__ import annotations

import time

from poolserve.service import Array, InvalidInput, Model


class SleepModel(Model):
    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        sleep_ms = parameters.get("sleep_ms", 100)
        if not isinstance(sleep_ms, int) or isinstance(sleep_ms, bool) or sleep_ms < 0:
            raise InvalidInput(f"parameter sleep_ms must be a non-negative int64, got {sleep_ms!r}")
        time.sleep(sleep_ms / 1000)
        return {"OUTPUT0": inputs["INPUT0"]}
