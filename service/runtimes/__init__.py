"""Built-in runtimes (``Model`` implementations), named by ``implementation``
in model-settings.json: ``poolserve.service.runtimes.SKLearnModel``.

Its import path is written in model files on disk, so it never moves, and it
is the one folder whose ``__init__`` imports (its public names). May import:
``inference`` (the model API), ``contract``.
"""

from poolserve.service.runtimes.sklearn import SKLearnModel

__all__ = ["SKLearnModel"]
