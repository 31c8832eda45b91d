"""burn: spins a pure-Python loop (about 20 ms of CPU), returns INPUT0 as OUTPUT0."""

from __future__ import annotations

from poolserve.service import Array, Model

DEFAULT_ITERATIONS = 500_000


def spin(iterations: int) -> int:
    total = 0
    for i in range(iterations):
        total += i & 7
    return total


class BurnModel(Model):
    def load(self) -> None:
        self.iterations = int(self.settings.extra.get("iterations", DEFAULT_ITERATIONS))

    def predict(self, inputs: dict[str, Array], parameters: dict[str, object]) -> dict[str, Array]:
        spin(self.iterations)
        return {"OUTPUT0": inputs["INPUT0"]}
