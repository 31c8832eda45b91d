"""Domain errors of poolserve, and the one table that maps them to gRPC codes.

Everything below the gRPC layer (codec, pool core, workers, repository) raises
a :class:`ServingError` subclass and never imports grpc for that purpose; the
servicers and the router turn an error into a status with :func:`grpc_status`.
Workers send :class:`Failure` values across the frame protocol, so the enum
values are part of that protocol.
"""

from __future__ import annotations

import enum

import grpc
from google.protobuf.message import DecodeError

MAX_SHOWN = 200  # characters of a client-given name that an error message repeats
MAX_MESSAGE = 2000  # characters of a status message; grpc's default metadata limit is 8 KiB


def clip(text: str, limit: int = MAX_SHOWN) -> str:
    """``text`` as an error message may repeat it: at most ``limit`` characters.

    Every name, version or datatype that a client sent goes through this
    before it appears in a message, so that a 1 MiB model name gets its
    NOT_FOUND, not a metadata-size error.
    """
    if len(text) <= limit:
        return text
    return f"{text[:limit]}...[{len(text)} characters]"


class Failure(enum.IntEnum):
    """What went wrong, independent of the transport."""

    INTERNAL = 1
    NOT_FOUND = 2
    INVALID_INPUT = 3
    UNAVAILABLE = 4
    QUEUE_FULL = 5
    DEADLINE = 6
    CANCELLED = 7
    TOO_LARGE = 8
    MODEL_ERROR = 9
    NOT_READY = 10
    UNIMPLEMENTED = 11
    FAILED_PRECONDITION = 12


_STATUS: dict[Failure, grpc.StatusCode] = {
    Failure.INTERNAL: grpc.StatusCode.INTERNAL,
    Failure.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    Failure.INVALID_INPUT: grpc.StatusCode.INVALID_ARGUMENT,
    Failure.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    Failure.QUEUE_FULL: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Failure.DEADLINE: grpc.StatusCode.DEADLINE_EXCEEDED,
    Failure.CANCELLED: grpc.StatusCode.CANCELLED,
    Failure.TOO_LARGE: grpc.StatusCode.RESOURCE_EXHAUSTED,
    Failure.MODEL_ERROR: grpc.StatusCode.INTERNAL,
    Failure.NOT_READY: grpc.StatusCode.UNAVAILABLE,
    Failure.UNIMPLEMENTED: grpc.StatusCode.UNIMPLEMENTED,
    Failure.FAILED_PRECONDITION: grpc.StatusCode.FAILED_PRECONDITION,
}


class ServingError(Exception):
    """Base of every error that reaches a client as a status and a message."""

    failure = Failure.INTERNAL

    def __init__(self, message: str, stage: str = "") -> None:
        super().__init__(message)
        self.message = message
        # where a deadline ran out: "router", "pool", "pool queue" or "worker"
        self.stage = stage


class InvalidInput(ServingError):
    """The request is malformed. Models may raise it too: INVALID_ARGUMENT."""

    failure = Failure.INVALID_INPUT


class ModelNotFound(ServingError):
    failure = Failure.NOT_FOUND


class ModelNotReady(ServingError):
    failure = Failure.NOT_READY


class Unavailable(ServingError):
    failure = Failure.UNAVAILABLE


class QueueFull(ServingError):
    failure = Failure.QUEUE_FULL


class DeadlineExceeded(ServingError):
    failure = Failure.DEADLINE


class Cancelled(ServingError):
    failure = Failure.CANCELLED


class MessageTooLarge(ServingError):
    failure = Failure.TOO_LARGE

    @classmethod
    def reply(cls, model: str, size: int, limit: int) -> MessageTooLarge:
        """A model's reply that gRPC would refuse to send: said here, clearly."""
        return cls(f"model '{model}' replied {size} bytes, over max_message_size ({limit} bytes)")


class ModelError(ServingError):
    """A model's own code raised: INTERNAL with the exception type and message."""

    failure = Failure.MODEL_ERROR

    @classmethod
    def from_exception(cls, model: str, exc: BaseException) -> ModelError:
        return cls(f"model '{model}' raised {type(exc).__name__}: {exc}")


class Unimplemented(ServingError):
    failure = Failure.UNIMPLEMENTED


class FailedPrecondition(ServingError):
    failure = Failure.FAILED_PRECONDITION


LOAD_FAILED = "failed to load '{}'"


def load_failed(name: str, exc: ServingError) -> ServingError:
    """``exc`` as a RepositoryModelLoad answers it: the message starts with
    ``failed to load '<name>'``, as Triton's do (clients and scripts match on it)."""
    prefix = LOAD_FAILED.format(clip(name))
    if exc.message.startswith(prefix):
        return exc
    error = error_for(exc.failure, f"{prefix}: {exc.message}")
    error.stage = exc.stage
    return error


def error_for(failure: Failure, message: str) -> ServingError:
    """Rebuilds a typed error from a failure code (for errors sent across frames)."""
    for cls in _BY_FAILURE:
        if cls.failure == failure:
            return cls(message)
    return ServingError(message)


_BY_FAILURE: tuple[type[ServingError], ...] = (
    InvalidInput,
    ModelNotFound,
    ModelNotReady,
    Unavailable,
    QueueFull,
    DeadlineExceeded,
    Cancelled,
    MessageTooLarge,
    ModelError,
    Unimplemented,
    FailedPrecondition,
)


def as_serving_error(exc: BaseException) -> ServingError:
    """Any exception as the error a client gets for it."""
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, DecodeError):  # bytes that are not the message they claim to be
        return InvalidInput(f"request cannot be parsed: {exc}")
    return ServingError(f"internal error: {type(exc).__name__}: {exc}")


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The status code and message a client sees for ``exc``.

    The message is cut to MAX_MESSAGE characters: a status message travels in
    a trailer, and one over the client's metadata limit would reach it as a
    metadata-size error instead of this status.
    """
    error = as_serving_error(exc)
    return _STATUS[error.failure], clip(error.message, MAX_MESSAGE)


_FAILURE_FOR_STATUS: dict[grpc.StatusCode, Failure] = {
    grpc.StatusCode.NOT_FOUND: Failure.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT: Failure.INVALID_INPUT,
    grpc.StatusCode.UNAVAILABLE: Failure.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Failure.QUEUE_FULL,
    grpc.StatusCode.DEADLINE_EXCEEDED: Failure.DEADLINE,
    grpc.StatusCode.CANCELLED: Failure.CANCELLED,
    grpc.StatusCode.UNIMPLEMENTED: Failure.UNIMPLEMENTED,
    grpc.StatusCode.FAILED_PRECONDITION: Failure.FAILED_PRECONDITION,
}


STAGE_METADATA = "poolserve-stage"  # trailing metadata: where the budget ran out


def from_upstream(code: grpc.StatusCode, details: str, where: str, stage: str = "") -> ServingError:
    """An error that a pool answered, as the router passes it on.

    The status code is kept; an empty message (a status made by the gRPC
    library rather than by a pool, e.g. the router's own deadline on the
    forwarded call) is replaced by one that says where it happened.
    """
    failure = _FAILURE_FOR_STATUS.get(code, Failure.INTERNAL)
    message = details or f"{code.name.lower().replace('_', ' ')} {where}"
    if code is grpc.StatusCode.UNAVAILABLE and not message.startswith("pool"):
        message = f"{where} is unavailable: {message}"
    error = error_for(failure, message)
    error.stage = stage
    return error
