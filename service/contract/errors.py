"""Domain errors of poolserve, as values: no transport in them.

Everything below the gRPC layer (codec, pool core, workers, repository) raises
a :class:`ServingError` subclass and never imports grpc for that purpose; the
servicers and the router turn an error into a status with
:func:`poolserve.service.grpcserver.status.grpc_status` (the one table from
errors to gRPC codes). Workers send :class:`Failure` values across the frame
protocol, so the enum values are part of that protocol.
"""

from __future__ import annotations

import enum

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
    ALREADY_EXISTS = 13


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


def unknown_model(name: str) -> ModelNotFound:
    """NOT_FOUND for a name the repository does not have, in Triton's words:
    clients match on "Request for unknown model" (Triton's
    simple_grpc_health_metadata.py does)."""
    return ModelNotFound(f"Request for unknown model: '{clip(name)}' is not in this repository")


class ModelNotReady(ServingError):
    failure = Failure.NOT_READY


class Unavailable(ServingError):
    failure = Failure.UNAVAILABLE


class QueueFull(ServingError):
    failure = Failure.QUEUE_FULL


class StreamStalled(QueueFull):
    """A ModelStreamInfer whose client took none of its responses for
    ``stream_stall_s``: it is ended, and its worker freed for other callers.
    RESOURCE_EXHAUSTED, as the router's other bounds on what an unread client
    may hold; the message names the setting."""

    @classmethod
    def after(cls, stall_s: float) -> StreamStalled:
        return cls(
            f"the stream was ended: its client took none of its responses for {stall_s:g} s "
            "while they waited to be sent (stream_stall_s); its worker is freed for other "
            "callers. Read a stream's responses as they come, or raise stream_stall_s"
        )


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


class NotFound(ServingError):
    """Something other than a model that the client named does not exist."""

    failure = Failure.NOT_FOUND


class AlreadyExists(ServingError):
    failure = Failure.ALREADY_EXISTS


LOAD_FAILED = "failed to load '{}'"


def load_failed(name: str, exc: ServingError) -> ServingError:
    """``exc`` as a RepositoryModelLoad answers it: the message starts with
    ``failed to load '<name>'``, as Triton's do (clients and scripts match on it)."""
    prefix = LOAD_FAILED.format(clip(name))
    if exc.message.startswith(prefix):
        return exc
    return prefixed(exc, prefix)


def prefixed(exc: ServingError, where: str) -> ServingError:
    """``exc`` with ``where`` in front of its message (``where: message``), its
    failure and stage kept: an ensemble's step naming itself, a load naming its model."""
    error = error_for(exc.failure, f"{where}: {exc.message}")
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
    AlreadyExists,
)


def decoupled_refusal(model: str) -> Unimplemented:
    """What unary ModelInfer answers for a decoupled model (Triton: UNSUPPORTED)."""
    return Unimplemented(
        f"ModelInfer RPC doesn't support models with decoupled transaction policy: "
        f"model '{model}' is decoupled (any number of responses); use ModelStreamInfer "
        f"(gRPC) or POST /v2/models/{model}/generate_stream (REST)"
    )
