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
    __slots__ = ("id", "pid", "state", "uptime_s", "restarts", "children", "pool")
    ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    CHILDREN_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    id: str
    pid: int
    state: str
    uptime_s: float
    restarts: int
    children: _containers.RepeatedCompositeFieldContainer[TreeNode]
    pool: PoolStatus
    def __init__(self, id: _Optional[str] = ..., pid: _Optional[int] = ..., state: _Optional[str] = ..., uptime_s: _Optional[float] = ..., restarts: _Optional[int] = ..., children: _Optional[_Iterable[_Union[TreeNode, _Mapping]]] = ..., pool: _Optional[_Union[PoolStatus, _Mapping]] = ...) -> None: ...

class TreeStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TreeStatus(_message.Message):
    __slots__ = ("root",)
    ROOT_FIELD_NUMBER: _ClassVar[int]
    root: TreeNode
    def __init__(self, root: _Optional[_Union[TreeNode, _Mapping]] = ...) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ReloadResponse(_message.Message):
    __slots__ = ("summary",)
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    summary: str
    def __init__(self, summary: _Optional[str] = ...) -> None: ...

class EnsurePoolRequest(_message.Message):
    __slots__ = ("gid",)
    GID_FIELD_NUMBER: _ClassVar[int]
    gid: str
    def __init__(self, gid: _Optional[str] = ...) -> None: ...

class EnsurePoolResponse(_message.Message):
    __slots__ = ("address",)
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    address: str
    def __init__(self, address: _Optional[str] = ...) -> None: ...
