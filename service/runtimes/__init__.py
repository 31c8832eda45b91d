"""Built-in runtimes, named by ``implementation`` in model-settings.json."""

from poolserve.service.runtimes.sklearn import SKLearnModel

__all__ = ["SKLearnModel"]
