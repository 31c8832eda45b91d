"""The data plane: settings and repository, codec, runtime API, workers, pools, router.

Model authors need only :class:`Model` and :class:`InvalidInput`.
"""

__version__ = "0.1.0"

from poolserve.service.errors import InvalidInput
from poolserve.service.model import Model

__all__ = ["InvalidInput", "Model", "__version__"]
