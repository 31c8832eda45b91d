"""An ensemble: a model whose settings name steps, each run by another model.

Two ways to write one in ``model-settings.json`` (``"platform": "ensemble"``,
no ``implementation``):

- ``parameters.extra.pipeline``: a list of model names (or ``{"model_name",
  "model_version"}``), KServe InferenceGraph's *sequence*: each step's
  declared outputs feed the next step's declared inputs, by position; the
  ensemble's inputs feed the first step, the last step's outputs are the
  ensemble's (by position with the ensemble's declared ``inputs`` and
  ``outputs``, or under the steps' own names when it declares none).
- ``parameters.extra.ensemble_scheduling``: Triton's ``ModelEnsembling``,
  ``{"step": [{"model_name", "model_version", "input_map", "output_map"}]}``,
  ``input_map`` from a step's input to an ensemble tensor, ``output_map``
  from a step's output to an ensemble tensor.

:func:`resolve` checks an ensemble against the repository's models (every
step a model there, every declared input of a step mapped, every tensor
produced once, no cycle) and orders its steps in levels: a level's steps
need only the ensemble's inputs and earlier levels' outputs, so they may run
together. Every error is a :class:`ConfigError` naming the field.
Standard library only.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from poolserve.service.contract.errors import InvalidInput
from poolserve.service.contract.settings import ConfigError

if TYPE_CHECKING:
    from poolserve.service.contract.repository import ModelSettings, TensorSpec

PLATFORM = "ensemble"
PIPELINE = "pipeline"
SCHEDULING = "ensemble_scheduling"
_STEP_FIELDS = {"model_name", "model_version", "input_map", "output_map"}


@dataclass(frozen=True)
class EnsembleStep:
    model: str
    version: str  # "" (Triton's -1): the model's version
    input_map: tuple[tuple[str, str], ...]  # (step input, ensemble tensor)
    output_map: tuple[tuple[str, str], ...]  # (step output, ensemble tensor)

    @property
    def where(self) -> str:
        return f"model '{self.model}'"


@dataclass(frozen=True)
class Ensemble:
    name: str
    version: str
    source: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    max_batch_size: int
    steps: tuple[EnsembleStep, ...]
    levels: tuple[tuple[int, ...], ...]  # step indexes, in dependency order

    def step_name(self, index: int) -> str:
        """How messages name a step: its number (from 1) and its model."""
        return f"ensemble '{self.name}' step {index + 1} ({self.steps[index].where})"


def check_input_names(given: Iterable[str], declared: Iterable[str]) -> None:
    """The inputs a request gives an ensemble are exactly its declared ones:
    InvalidInput naming the first unexpected or missing one (the router's
    steps and a worker's chain say it in the same words)."""
    wanted = set(declared)
    names = list(given)
    for name in names:
        if name not in wanted:
            raise InvalidInput(
                f"unexpected inference input '{name}' (the ensemble's inputs: "
                f"{', '.join(sorted(wanted))})"
            )
    for name in sorted(wanted - set(names)):
        raise InvalidInput(f"expected input '{name}' of the ensemble, none given")


def is_ensemble(platform: str, implementation: object, extra: Mapping[str, Any]) -> bool:
    """An ensemble says ``"platform": "ensemble"``, or names steps without an implementation."""
    return platform == PLATFORM or (
        implementation is None and (PIPELINE in extra or SCHEDULING in extra)
    )


def resolve(ensemble: ModelSettings, models: Mapping[str, ModelSettings]) -> Ensemble:
    """The ensemble's plan, checked against the repository's (non-ensemble) models."""
    source = str(ensemble.source)
    extra = ensemble.extra
    if (PIPELINE in extra) == (SCHEDULING in extra):
        raise ConfigError(
            source,
            "parameters.extra",
            f"an ensemble names its steps in exactly one of '{PIPELINE}' (a list of models, "
            f"each feeding the next) or '{SCHEDULING}' (Triton's steps with input and output maps)",
        )
    if PIPELINE in extra:
        steps = _pipeline(source, ensemble, extra[PIPELINE], models)
    else:
        steps = _scheduling(source, extra[SCHEDULING])
    for i, step in enumerate(steps):
        _check_step(source, i, step, models)
    inputs, outputs, levels = _plan(source, ensemble, steps, models)
    return Ensemble(
        name=ensemble.name,
        version=ensemble.version,
        source=source,
        inputs=inputs,
        outputs=outputs,
        max_batch_size=ensemble.max_batch_size,
        steps=tuple(steps),
        levels=levels,
    )


def _version_order(version: str) -> tuple[int, str]:
    return (int(version), "") if version.isdigit() else (0, version)


def _version(source: str, key: str, value: object) -> str:
    if value is None or value == -1 or value == "":
        return ""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return str(value)
    if isinstance(value, str) and value.isdigit():
        return value
    raise ConfigError(source, key, f"expected a version number (or -1: the model's), got {value!r}")


def _name_map(source: str, key: str, value: object) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) and v for k, v in value.items()
    ):
        raise ConfigError(source, key, "expected an object of tensor names to tensor names")
    return tuple(value.items())


def _scheduling(source: str, value: object) -> list[EnsembleStep]:
    key = f"parameters.extra.{SCHEDULING}"
    if not isinstance(value, dict) or set(value) != {"step"} or not isinstance(value["step"], list):
        raise ConfigError(source, key, 'expected {"step": [...]}')
    if not value["step"]:
        raise ConfigError(source, f"{key}.step", "an ensemble needs at least one step")
    steps = []
    for i, item in enumerate(value["step"]):
        where = f"{key}.step[{i}]"
        if not isinstance(item, dict) or not isinstance(item.get("model_name"), str):
            raise ConfigError(source, where, "expected {model_name, input_map, output_map}")
        unknown = set(item) - _STEP_FIELDS
        if unknown:
            raise ConfigError(source, f"{where}.{sorted(unknown)[0]}", "unknown field")
        output_map = _name_map(source, f"{where}.output_map", item.get("output_map"))
        if not output_map:
            raise ConfigError(source, f"{where}.output_map", "a step must produce a tensor")
        steps.append(
            EnsembleStep(
                model=item["model_name"],
                version=_version(source, f"{where}.model_version", item.get("model_version")),
                input_map=_name_map(source, f"{where}.input_map", item.get("input_map", {})),
                output_map=output_map,
            )
        )
    return steps


def _pipeline(
    source: str, ensemble: ModelSettings, value: object, models: Mapping[str, ModelSettings]
) -> list[EnsembleStep]:
    """KServe's sequence: each step's outputs are the next one's inputs, by position."""
    key = f"parameters.extra.{PIPELINE}"
    if not isinstance(value, list) or not value:
        raise ConfigError(source, key, "expected a list of model names, in the order they run")
    named: list[tuple[str, str]] = []
    for i, item in enumerate(value):
        where = f"{key}[{i}]"
        if isinstance(item, str):
            named.append((item, ""))
        elif isinstance(item, dict) and isinstance(item.get("model_name"), str):
            unknown = set(item) - {"model_name", "model_version"}
            if unknown:
                raise ConfigError(source, f"{where}.{sorted(unknown)[0]}", "unknown field")
            named.append((item["model_name"], _version(source, where, item.get("model_version"))))
        else:
            raise ConfigError(source, where, "expected a model name")
    specs = []
    for i, (name, _) in enumerate(named):
        model = _step_model(source, f"{key}[{i}]", name, models)
        if not model.inputs or not model.outputs:
            raise ConfigError(
                source,
                f"{key}[{i}]",
                f"model '{name}' declares no inputs or no outputs in its settings: a pipeline "
                f"feeds each step's outputs to the next by position (or use '{SCHEDULING}')",
            )
        specs.append(model)
    steps = []
    feeding = [s.name for s in ensemble.inputs] or [s.name for s in specs[0].inputs]
    for i, ((name, version), model) in enumerate(zip(named, specs, strict=True)):
        if len(feeding) != len(model.inputs):
            what = "the ensemble's inputs" if i == 0 else f"model '{named[i - 1][0]}''s outputs"
            raise ConfigError(
                source,
                f"{key}[{i}]",
                f"model '{name}' takes {len(model.inputs)} inputs "
                f"({', '.join(s.name for s in model.inputs)}) but {what} are {len(feeding)} "
                f"({', '.join(feeding)})",
            )
        last = i == len(named) - 1
        if last and ensemble.outputs:
            if len(ensemble.outputs) != len(model.outputs):
                raise ConfigError(
                    source,
                    "outputs",
                    f"the ensemble declares {len(ensemble.outputs)} outputs, its last step "
                    f"('{name}') {len(model.outputs)}",
                )
            produced = [s.name for s in ensemble.outputs]
        elif last:
            produced = [s.name for s in model.outputs]
        else:
            produced = [f"{i + 1}.{name}.{s.name}" for s in model.outputs]  # inside the ensemble
        steps.append(
            EnsembleStep(
                model=name,
                version=version,
                input_map=tuple(zip((s.name for s in model.inputs), feeding, strict=True)),
                output_map=tuple(zip((s.name for s in model.outputs), produced, strict=True)),
            )
        )
        feeding = produced
    return steps


def _step_model(
    source: str, where: str, name: str, models: Mapping[str, ModelSettings]
) -> ModelSettings:
    model = models.get(name)
    if model is None:
        raise ConfigError(
            source,
            where,
            f"step model '{name}' is not a model of this repository "
            "(an ensemble's steps are models; nested ensembles are not supported)",
        )
    return model


def _check_step(
    source: str, index: int, step: EnsembleStep, models: Mapping[str, ModelSettings]
) -> None:
    where = f"step {index + 1}"
    model = _step_model(source, where, step.model, models)
    if step.version and step.version != model.version:
        # ``models`` holds each version of a numbered model as ``name:version`` too
        versioned = models.get(f"{step.model}:{step.version}")
        if versioned is None:
            served = sorted(
                (m.version for key, m in models.items() if key.startswith(f"{step.model}:")),
                key=_version_order,
            ) or [model.version]
            raise ConfigError(
                source,
                f"{where}.model_version",
                f"model '{step.model}' has version {', '.join(served)}, not {step.version}",
            )
        model = versioned
    if model.decoupled:
        raise ConfigError(
            source, where, f"model '{step.model}' is decoupled: an ensemble's steps answer once"
        )
    declared = {s.name for s in model.inputs}
    if declared:
        for name, _ in step.input_map:
            if name not in declared:
                raise ConfigError(
                    source,
                    f"{where}.input_map.{name}",
                    f"'{name}' is not an input of model '{step.model}' "
                    f"(its inputs: {', '.join(sorted(declared))})",
                )
        mapped = {name for name, _ in step.input_map}
        for name in sorted(declared - mapped):
            raise ConfigError(
                source,
                f"{where}.input_map",
                f"input '{name}' of model '{step.model}' is not mapped to an ensemble tensor",
            )
    outputs = {s.name for s in model.outputs}
    for name, _ in step.output_map:
        if outputs and name not in outputs:
            raise ConfigError(
                source,
                f"{where}.output_map.{name}",
                f"'{name}' is not an output of model '{step.model}' "
                f"(its outputs: {', '.join(sorted(outputs))})",
            )


def _spec(specs: tuple[TensorSpec, ...], name: str) -> TensorSpec | None:
    return next((s for s in specs if s.name == name), None)


def _plan(
    source: str,
    ensemble: ModelSettings,
    steps: list[EnsembleStep],
    models: Mapping[str, ModelSettings],
) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...], tuple[tuple[int, ...], ...]]:
    """The ensemble's inputs and outputs (declared, or found from its steps) and
    its steps' levels; every tensor produced once, every one consumed known."""
    producer: dict[str, int] = {}
    for i, step in enumerate(steps):
        for _, tensor in step.output_map:
            if tensor in producer:
                raise ConfigError(
                    source,
                    f"step {i + 1}.output_map",
                    f"ensemble tensor '{tensor}' is produced by steps {producer[tensor] + 1} "
                    f"and {i + 1}",
                )
            producer[tensor] = i
    inputs = ensemble.inputs
    declared = {s.name for s in inputs}
    for name in declared & set(producer):
        raise ConfigError(
            source,
            "inputs",
            f"ensemble input '{name}' is also produced by step {producer[name] + 1}",
        )
    found: list[TensorSpec] = []
    for i, step in enumerate(steps):
        model = models[step.model]
        for step_input, tensor in step.input_map:
            if tensor in producer or tensor in declared:
                continue
            if ensemble.inputs:
                raise ConfigError(
                    source,
                    f"step {i + 1}.input_map.{step_input}",
                    f"ensemble tensor '{tensor}' is neither an input of the ensemble nor "
                    "produced by a step",
                )
            spec = _spec(model.inputs, step_input)
            if spec is None:
                raise ConfigError(
                    source,
                    "inputs",
                    f"declare the ensemble's input '{tensor}' (model '{step.model}' does not "
                    f"declare its input '{step_input}')",
                )
            if _spec(tuple(found), tensor) is None:
                found.append(dataclasses.replace(spec, name=tensor))
    if not inputs:
        inputs = tuple(found)
    outputs = ensemble.outputs
    for spec in outputs:
        if spec.name not in producer:
            raise ConfigError(
                source, "outputs", f"ensemble output '{spec.name}' is not produced by any step"
            )
    if not outputs:
        consumed = {t for step in steps for _, t in step.input_map}
        derived = []
        for step in steps:
            model = models[step.model]
            for step_output, tensor in step.output_map:
                spec = _spec(model.outputs, step_output)
                if tensor in consumed:
                    continue
                if spec is None:
                    raise ConfigError(
                        source,
                        "outputs",
                        f"declare the ensemble's output '{tensor}' (model '{step.model}' does "
                        f"not declare its output '{step_output}')",
                    )
                derived.append(dataclasses.replace(spec, name=tensor))
        outputs = tuple(derived)
    return inputs, outputs, _levels(source, steps, {s.name for s in inputs})


def _levels(
    source: str, steps: list[EnsembleStep], inputs: set[str]
) -> tuple[tuple[int, ...], ...]:
    ready = set(inputs)
    left = list(range(len(steps)))
    levels: list[tuple[int, ...]] = []
    while left:
        level = tuple(i for i in left if all(t in ready for _, t in steps[i].input_map))
        if not level:
            names = ", ".join(f"step {i + 1} ('{steps[i].model}')" for i in left)
            raise ConfigError(
                source,
                "steps",
                f"{names} form a cycle: each waits for a tensor that another of them produces",
            )
        levels.append(level)
        for i in level:
            ready.update(t for _, t in steps[i].output_map)
        left = [i for i in left if i not in level]
    return tuple(levels)
