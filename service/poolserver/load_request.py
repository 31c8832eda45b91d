"""What a RepositoryModelLoad asks for besides a name: Triton's ``config`` override.

Triton's clients send ``parameters["config"]``, a model configuration in
ModelConfig's JSON form (64-bit integers may come as strings, as protobuf's
JSON mapping writes them), and ``parameters["file:<path>"]`` with the bytes
of model files. poolserve applies what it can honour (``max_batch_size``;
``parameters``, merged into the model's ``parameters.extra``; ``version_policy``,
which of a numbered model's version folders the load serves), accepts
``name``, ``platform``, ``backend``, ``input`` and ``output`` when they agree
with the model, and refuses everything else by name: INVALID_ARGUMENT for
config it does not support, UNIMPLEMENTED for ``file:`` overrides.

Everything here is pure: the pool calls it before touching any file.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from poolserve.protos import inference_pb2 as pb
from poolserve.service.contract.errors import InvalidInput, Unimplemented, clip
from poolserve.service.contract.repository import ModelSettings, TensorSpec
from poolserve.service.contract.settings import ConfigError
from poolserve.service.contract.versions import FIELD as VERSION_POLICY
from poolserve.service.contract.versions import VersionPolicy, parse_version_policy
from poolserve.service.poolserver.metadata import PLATFORM

APPLIED = ("max_batch_size", "parameters", VERSION_POLICY)
CHECKED = ("name", "platform", "backend", "input", "output")
BACKEND = "python"  # what ModelConfig reports for every poolserve model
_TENSOR_FIELDS = ("name", "data_type", "dims", "format", "label_filename")
_INT = re.compile(r"^-?[0-9]+$")
_MAX_INT32 = 2**31 - 1
MAX_CONFIG_BYTES = 16 * 1024  # the override travels to the zygote in one 64 KiB message


@dataclass(frozen=True)
class LoadRequest:
    """A parsed RepositoryModelLoad: the model and what its config override says."""

    name: str
    max_batch_size: int | None = None
    parameters: Mapping[str, object] = field(default_factory=dict)
    checked: Mapping[str, Any] = field(default_factory=dict)  # must agree with the model
    # Triton's version_policy: which numbered version folders this load serves
    version_policy: VersionPolicy | None = None
    key: str = ""  # the override in canonical form: loads with equal keys coalesce

    def apply(
        self, settings: ModelSettings, specs: tuple[Sequence[TensorSpec], Sequence[TensorSpec]]
    ) -> ModelSettings:
        """The settings this load means; raises InvalidInput where config disagrees.

        ``specs`` are the model's known (inputs, outputs), for the checks of
        ``input`` and ``output``.
        """
        if self.max_batch_size is not None:
            settings = replace(settings, max_batch_size=self.max_batch_size)
        if self.parameters:
            settings = replace(settings, extra={**settings.extra, **self.parameters})
        for key, value in self.checked.items():
            _check_agrees(key, value, settings, specs)
        return settings

    def overrides(self, settings: ModelSettings) -> dict[str, Any]:
        """The fields of ``settings`` that the zygote must set over the file's (JSON)."""
        out: dict[str, Any] = {}
        if self.max_batch_size is not None:
            out["max_batch_size"] = settings.max_batch_size
        if self.parameters:
            out["extra"] = dict(settings.extra)
        return out


def parse_load_request(request: pb.RepositoryModelLoadRequest) -> LoadRequest:
    """The request's parameters, checked; raises InvalidInput or Unimplemented."""
    name = request.model_name
    files = sorted(key for key in request.parameters if key.startswith("file:"))
    if files:
        raise Unimplemented(
            f"parameter '{clip(files[0])}': file overrides (model files sent with the load) "
            "are not supported; put the files in the model repository and load by name"
        )
    unknown = sorted(key for key in request.parameters if key != "config")
    if unknown:
        raise InvalidInput(
            f"unknown parameter '{clip(unknown[0])}'; RepositoryModelLoad understands "
            "'config' (and refuses 'file:' overrides)"
        )
    if "config" not in request.parameters:
        return LoadRequest(name)
    param = request.parameters["config"]
    if param.WhichOneof("parameter_choice") != "string_param":
        raise InvalidInput("parameter 'config' must be a string_param holding JSON")
    return parse_config(name, param.string_param)


def parse_config(name: str, text: str) -> LoadRequest:
    if len(text.encode()) > MAX_CONFIG_BYTES:
        raise InvalidInput(f"config is larger than {MAX_CONFIG_BYTES} bytes")
    try:
        config = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise InvalidInput(f"config is not valid JSON: {clip(str(exc))}") from None
    if not isinstance(config, dict):
        raise InvalidInput("config must be a JSON object (Triton's ModelConfig)")
    unsupported = sorted(key for key in config if key not in APPLIED + CHECKED)
    if unsupported:
        listed = ", ".join(clip(key) for key in unsupported[:20])
        raise InvalidInput(
            f"config fields not supported by poolserve: {listed} (it applies "
            f"{' and '.join(APPLIED)}, and accepts {', '.join(CHECKED)} that agree with the model)"
        )
    batch = config.get("max_batch_size")
    policy = None
    if VERSION_POLICY in config:
        try:
            policy = parse_version_policy("config", config[VERSION_POLICY])
        except ConfigError as exc:
            raise InvalidInput(f"config field '{exc.field_name}': {clip(exc.problem)}") from None
    return LoadRequest(
        name,
        max_batch_size=None if batch is None else _int32("max_batch_size", batch),
        parameters=_parameters(config.get("parameters", {})),
        checked={key: config[key] for key in CHECKED if key in config},
        key=json.dumps(config, sort_keys=True),
        version_policy=policy,
    )


def _int32(where: str, value: object) -> int:
    """An integer of ModelConfig's JSON form: a number, or a string of digits."""
    if isinstance(value, str) and _INT.match(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"config field '{where}' must be an integer, got {clip(repr(value))}")
    if not 0 <= value <= _MAX_INT32:
        raise InvalidInput(f"config field '{where}' is out of range: {value}")
    return value


def _parameters(value: object) -> dict[str, object]:
    """ModelConfig's ``parameters``: ``{"key": {"string_value": "..."}}`` (plain
    JSON scalars are taken as they are)."""
    if not isinstance(value, dict):
        raise InvalidInput("config field 'parameters' must be an object")
    out: dict[str, object] = {}
    for key, item in value.items():
        if isinstance(item, dict) and set(item) == {"string_value"}:
            item = item["string_value"]
        if not isinstance(item, str | int | float | bool):
            raise InvalidInput(
                f"config field 'parameters.{clip(key)}' must be {{\"string_value\": ...}} "
                "or a plain string, number or boolean"
            )
        out[key] = item
    return out


def _check_agrees(
    key: str,
    value: object,
    settings: ModelSettings,
    specs: tuple[Sequence[TensorSpec], Sequence[TensorSpec]],
) -> None:
    expected: object
    if key == "name":
        expected = settings.name
    elif key == "platform":
        expected = settings.platform or PLATFORM
    elif key == "backend":
        expected = BACKEND
    else:
        known = specs[0] if key == "input" else specs[1]
        _check_tensors(key, value, known, settings.max_batch_size)
        return
    if value != expected:
        raise InvalidInput(
            f"config field '{key}' is {clip(repr(value))} but the model's is {expected!r}; "
            "poolserve cannot change it"
        )


def _check_tensors(
    key: str, value: object, known: Sequence[TensorSpec], max_batch_size: int
) -> None:
    if not isinstance(value, list):
        raise InvalidInput(f"config field '{key}' must be a list")
    if not known:
        raise InvalidInput(
            f"config field '{key}' cannot be checked: the model declares no {key}s "
            "in its settings; leave it out"
        )
    by_name = {spec.name: spec for spec in known}
    skip = 1 if max_batch_size > 0 else 0  # Triton's dims leave out the batch dimension
    for index, item in enumerate(value):
        where = f"{key}[{index}]"
        if not isinstance(item, dict):
            raise InvalidInput(f"config field '{where}' must be an object")
        extra = sorted(k for k in item if k not in _TENSOR_FIELDS)
        if extra:
            raise InvalidInput(f"config field '{where}.{clip(extra[0])}' is not supported")
        spec = by_name.get(item.get("name"))  # type: ignore[arg-type]
        if spec is None:
            raise InvalidInput(
                f"config field '{where}' names {clip(repr(item.get('name')))}, not one of the "
                f"model's {key}s ({', '.join(by_name)})"
            )
        if "data_type" in item and _datatype(where, item["data_type"]) != spec.datatype:
            raise InvalidInput(
                f"config field '{where}.data_type' is {clip(repr(item['data_type']))} but "
                f"{key} '{spec.name}' is {spec.datatype}"
            )
        for name, known_value, default in (
            ("format", spec.format, "FORMAT_NONE"),
            ("label_filename", spec.label_filename, ""),
        ):
            value = item.get(name, default)
            if name == "format" and isinstance(value, int) and not isinstance(value, bool):
                value = {number: text for text, number in pb.ModelInput.Format.items()}.get(
                    value, value
                )
            if value != known_value:
                raise InvalidInput(
                    f"config field '{where}.{name}' is {clip(repr(item.get(name)))} but "
                    f"{key} '{spec.name}' has {known_value!r}; poolserve cannot change it"
                )
        if "dims" in item:
            dims = item["dims"]
            if not isinstance(dims, list):
                raise InvalidInput(f"config field '{where}.dims' must be a list")
            wanted = list(spec.shape[skip:])
            if [_int64(f"{where}.dims", d) for d in dims] != wanted:
                raise InvalidInput(
                    f"config field '{where}.dims' is {clip(repr(dims))} but {key} "
                    f"'{spec.name}' has dims {wanted}"
                )


def _int64(where: str, value: object) -> int:
    if isinstance(value, str) and _INT.match(value):
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidInput(f"config field '{where}' must hold integers, got {clip(repr(value))}")
    return value


def _datatype(where: str, value: object) -> str:
    """A ModelConfig data_type (``TYPE_FP32`` or its enum number) as a protocol datatype."""
    if isinstance(value, int) and not isinstance(value, bool):
        try:
            value = pb.DataType.Name(value)
        except ValueError:
            raise InvalidInput(f"config field '{where}.data_type': unknown {value}") from None
    if not isinstance(value, str) or not value.startswith("TYPE_"):
        raise InvalidInput(f"config field '{where}.data_type' must be like 'TYPE_FP32'")
    return "BYTES" if value == "TYPE_STRING" else value.removeprefix("TYPE_")
