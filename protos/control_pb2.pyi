from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerStatus(_message.Message):
    __slots__ = ("pid", "state", "requests_served", "restarts")
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_SERVED_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    pid: int
    state: str
    requests_served: int
    restarts: int
    def __init__(self, pid: _Optional[int] = ..., state: _Optional[str] = ..., requests_served: _Optional[int] = ..., restarts: _Optional[int] = ...) -> None: ...

class ModelState(_message.Message):
    __slots__ = ("name", "version", "state", "reason")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    state: str
    reason: str
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., state: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class PoolStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("gid", "pid", "zygote_pid", "queue_depth", "workers", "pss_bytes", "models", "late_replies_dropped")
    GID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    ZYGOTE_PID_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    PSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    LATE_REPLIES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    gid: str
    pid: int
    zygote_pid: int
    queue_depth: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    pss_bytes: int
    models: _containers.RepeatedCompositeFieldContainer[ModelState]
    late_replies_dropped: int
    def __init__(self, gid: _Optional[str] = ..., pid: _Optional[int] = ..., zygote_pid: _Optional[int] = ..., queue_depth: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., pss_bytes: _Optional[int] = ..., models: _Optional[_Iterable[_Union[ModelState, _Mapping]]] = ..., late_replies_dropped: _Optional[int] = ...) -> None: ...

class TreeNode(_message.Message):
    __slots__ = ("id", "pid", "state", "uptime_s", "restarts", "children", "pool", "last_exit", "pool_error")
    ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    LAST_EXIT_FIELD_NUMBER: _ClassVar[int]
    POOL_ERROR_FIELD_NUMBER: _ClassVar[int]
    id: str
    pid: int
    state: str
    uptime_s: float
    restarts: int
    children: _containers.RepeatedCompositeFieldContainer[TreeNode]
    pool: PoolStatus
    last_exit: str
    pool_error: str
    def __init__(self, id: _Optional[str] = ..., pid: _Optional[int] = ..., state: _Optional[str] = ..., uptime_s: _Optional[float] = ..., restarts: _Optional[int] = ..., children: _Optional[_Iterable[_Union[TreeNode, _Mapping]]] = ..., pool: _Optional[_Union[PoolStatus, _Mapping]] = ..., last_exit: _Optional[str] = ..., pool_error: _Optional[str] = ...) -> None: ...

class TreeStatusRequest(_message.Message):
    __slots__ = ("skip_pools",)
    SKIP_POOLS_FIELD_NUMBER: _ClassVar[int]
    skip_pools: bool
    def __init__(self, skip_pools: _Optional[bool] = ...) -> None: ...

class TreeStatus(_message.Message):
    __slots__ = ("root",)
    ROOT_FIELD_NUMBER: _ClassVar[int]
    root: TreeNode
    def __init__(self, root: _Optional[_Union[TreeNode, _Mapping]] = ...) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadResponse(_message.Message):
    __slots__ = ("summary", "ok", "started", "stopped", "updated", "restarted", "failures", "router_updated")
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    STOPPED_FIELD_NUMBER: _ClassVar[int]
    UPDATED_FIELD_NUMBER: _ClassVar[int]
    RESTARTED_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    ROUTER_UPDATED_FIELD_NUMBER: _ClassVar[int]
    summary: str
    ok: bool
    started: _containers.RepeatedScalarFieldContainer[str]
    stopped: _containers.RepeatedScalarFieldContainer[str]
    updated: _containers.RepeatedScalarFieldContainer[str]
    restarted: _containers.RepeatedScalarFieldContainer[str]
    failures: _containers.RepeatedScalarFieldContainer[str]
    router_updated: bool
    def __init__(self, summary: _Optional[str] = ..., ok: _Optional[bool] = ..., started: _Optional[_Iterable[str]] = ..., stopped: _Optional[_Iterable[str]] = ..., updated: _Optional[_Iterable[str]] = ..., restarted: _Optional[_Iterable[str]] = ..., failures: _Optional[_Iterable[str]] = ..., router_updated: _Optional[bool] = ...) -> None: ...

class EnsurePoolRequest(_message.Message):
    __slots__ = ("gid",)
    GID_FIELD_NUMBER: _ClassVar[int]
    gid: str
    def __init__(self, gid: _Optional[str] = ...) -> None: ...

class EnsurePoolResponse(_message.Message):
    __slots__ = ("address", "started")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    address: str
    started: bool
    def __init__(self, address: _Optional[str] = ..., started: _Optional[bool] = ...) -> None: ...

class PoolRoutes(_message.Message):
    __slots__ = ("gid", "address", "models")
    GID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    gid: str
    address: str
    models: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, gid: _Optional[str] = ..., address: _Optional[str] = ..., models: _Optional[_Iterable[str]] = ...) -> None: ...

class InvalidModelRoute(_message.Message):
    __slots__ = ("name", "reason")
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    name: str
    reason: str
    def __init__(self, name: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class RouteTable(_message.Message):
    __slots__ = ("generation", "pools", "invalid")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    POOLS_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    generation: int
    pools: _containers.RepeatedCompositeFieldContainer[PoolRoutes]
    invalid: _containers.RepeatedCompositeFieldContainer[InvalidModelRoute]
    def __init__(self, generation: _Optional[int] = ..., pools: _Optional[_Iterable[_Union[PoolRoutes, _Mapping]]] = ..., invalid: _Optional[_Iterable[_Union[InvalidModelRoute, _Mapping]]] = ...) -> None: ...

class SetRoutesResponse(_message.Message):
    __slots__ = ("generation",)
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    generation: int
    def __init__(self, generation: _Optional[int] = ...) -> None: ...
