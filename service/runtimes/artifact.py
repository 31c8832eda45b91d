"""A built-in runtime's model file (``parameters.uri``): its path, or an error
that says what is missing and, when the model's folder holds a ``train.py``,
the one command that makes it.

The examples ship their training scripts, not their trained files (a joblib
file is bound to the scikit-learn release that wrote it), so a fresh clone
served before training names the command in the load error's one log line.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path

from poolserve.service.contract.repository import ModelSettings

TRAINER = "train.py"  # beside model-settings.json: makes the model's file


def model_file(settings: ModelSettings, kind: str) -> Path:
    """The file ``parameters.uri`` names; ``kind`` says what it must be (for the errors)."""
    if not settings.uri:
        raise ValueError(f"{settings.source}: parameters.uri must name {kind}")
    path = Path(settings.uri)
    if not path.is_file():
        raise FileNotFoundError(missing(path, settings.folder))
    return path


def missing(path: Path, folder: Path) -> str:
    """Why ``path`` cannot load, and how to make it when ``folder`` says how."""
    why = f"the model file {_shown(path)} does not exist"
    trainer = folder / TRAINER
    if not trainer.is_file():
        return why
    command = shlex.join([_shown(Path(sys.executable)), _shown(trainer)])
    return f"{why}; {TRAINER} beside the model's settings makes it: {command}"


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it (shorter to copy)."""
    absolute = path.absolute()
    here = Path.cwd()
    return os.path.relpath(absolute, here) if absolute.is_relative_to(here) else str(path)
