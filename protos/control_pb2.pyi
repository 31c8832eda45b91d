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

class Histogram(_message.Message):
    __slots__ = ("buckets", "sum_ns")
    BUCKETS_FIELD_NUMBER: _ClassVar[int]
    SUM_NS_FIELD_NUMBER: _ClassVar[int]
    buckets: _containers.RepeatedScalarFieldContainer[int]
    sum_ns: int
    def __init__(self, buckets: _Optional[_Iterable[int]] = ..., sum_ns: _Optional[int] = ...) -> None: ...

class ModelMetrics(_message.Message):
    __slots__ = ("name", "version", "ready", "success", "failures", "inference_count", "execution_count", "request_ns", "queue_ns", "compute_input_ns", "compute_infer_ns", "compute_output_ns", "request", "queue", "compute", "deadline_exceeded", "batch_sizes", "cache_hits", "cache_misses", "cache_hit_ns", "cache_miss_ns")
    class FailuresEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class DeadlineExceededEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class BatchSizesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    SUCCESS_FIELD_NUMBER: _ClassVar[int]
    FAILURES_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_COUNT_FIELD_NUMBER: _ClassVar[int]
    EXECUTION_COUNT_FIELD_NUMBER: _ClassVar[int]
    REQUEST_NS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INPUT_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_INFER_NS_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_OUTPUT_NS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    QUEUE_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_EXCEEDED_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_NS_FIELD_NUMBER: _ClassVar[int]
    CACHE_MISS_NS_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    ready: bool
    success: int
    failures: _containers.ScalarMap[str, int]
    inference_count: int
    execution_count: int
    request_ns: int
    queue_ns: int
    compute_input_ns: int
    compute_infer_ns: int
    compute_output_ns: int
    request: Histogram
    queue: Histogram
    compute: Histogram
    deadline_exceeded: _containers.ScalarMap[str, int]
    batch_sizes: _containers.ScalarMap[int, int]
    cache_hits: int
    cache_misses: int
    cache_hit_ns: int
    cache_miss_ns: int
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., ready: _Optional[bool] = ..., success: _Optional[int] = ..., failures: _Optional[_Mapping[str, int]] = ..., inference_count: _Optional[int] = ..., execution_count: _Optional[int] = ..., request_ns: _Optional[int] = ..., queue_ns: _Optional[int] = ..., compute_input_ns: _Optional[int] = ..., compute_infer_ns: _Optional[int] = ..., compute_output_ns: _Optional[int] = ..., request: _Optional[_Union[Histogram, _Mapping]] = ..., queue: _Optional[_Union[Histogram, _Mapping]] = ..., compute: _Optional[_Union[Histogram, _Mapping]] = ..., deadline_exceeded: _Optional[_Mapping[str, int]] = ..., batch_sizes: _Optional[_Mapping[int, int]] = ..., cache_hits: _Optional[int] = ..., cache_misses: _Optional[int] = ..., cache_hit_ns: _Optional[int] = ..., cache_miss_ns: _Optional[int] = ...) -> None: ...

class ResponseCacheMetrics(_message.Message):
    __slots__ = ("entries", "bytes", "max_entries", "max_bytes", "evictions")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    entries: int
    bytes: int
    max_entries: int
    max_bytes: int
    evictions: int
    def __init__(self, entries: _Optional[int] = ..., bytes: _Optional[int] = ..., max_entries: _Optional[int] = ..., max_bytes: _Optional[int] = ..., evictions: _Optional[int] = ...) -> None: ...

class ProcessMetrics(_message.Message):
    __slots__ = ("pid", "kind", "state", "rss_bytes", "pss_bytes", "cpu_seconds")
    PID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    RSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PSS_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPU_SECONDS_FIELD_NUMBER: _ClassVar[int]
    pid: int
    kind: str
    state: str
    rss_bytes: int
    pss_bytes: int
    cpu_seconds: float
    def __init__(self, pid: _Optional[int] = ..., kind: _Optional[str] = ..., state: _Optional[str] = ..., rss_bytes: _Optional[int] = ..., pss_bytes: _Optional[int] = ..., cpu_seconds: _Optional[float] = ...) -> None: ...

class PoolMetricsRequest(_message.Message):
    __slots__ = ("pss",)
    PSS_FIELD_NUMBER: _ClassVar[int]
    pss: bool
    def __init__(self, pss: _Optional[bool] = ...) -> None: ...

class PoolMetrics(_message.Message):
    __slots__ = ("gid", "instance", "queue_depth", "workers", "worker_restarts", "models", "processes", "bucket_bounds_s", "cache")
    class WorkersEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class WorkerRestartsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    GID_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    WORKER_RESTARTS_FIELD_NUMBER: _ClassVar[int]
    MODELS_FIELD_NUMBER: _ClassVar[int]
    PROCESSES_FIELD_NUMBER: _ClassVar[int]
    BUCKET_BOUNDS_S_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    gid: str
    instance: str
    queue_depth: int
    workers: _containers.ScalarMap[str, int]
    worker_restarts: _containers.ScalarMap[str, int]
    models: _containers.RepeatedCompositeFieldContainer[ModelMetrics]
    processes: _containers.RepeatedCompositeFieldContainer[ProcessMetrics]
    bucket_bounds_s: _containers.RepeatedScalarFieldContainer[float]
    cache: ResponseCacheMetrics
    def __init__(self, gid: _Optional[str] = ..., instance: _Optional[str] = ..., queue_depth: _Optional[int] = ..., workers: _Optional[_Mapping[str, int]] = ..., worker_restarts: _Optional[_Mapping[str, int]] = ..., models: _Optional[_Iterable[_Union[ModelMetrics, _Mapping]]] = ..., processes: _Optional[_Iterable[_Union[ProcessMetrics, _Mapping]]] = ..., bucket_bounds_s: _Optional[_Iterable[float]] = ..., cache: _Optional[_Union[ResponseCacheMetrics, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("root", "invalid")
    ROOT_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    root: TreeNode
    invalid: _containers.RepeatedCompositeFieldContainer[InvalidModelRoute]
    def __init__(self, root: _Optional[_Union[TreeNode, _Mapping]] = ..., invalid: _Optional[_Iterable[_Union[InvalidModelRoute, _Mapping]]] = ...) -> None: ...

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
