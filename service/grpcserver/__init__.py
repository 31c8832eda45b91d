"""What the router and the pool server share as gRPC servers: the one table
from errors to gRPC statuses (``status``), guarded handlers and deadlines
(``handlers``), health (``health``), tracing (``tracing``), private unix
sockets (``sockets``), model-control pacing (``pacing``), the shared-memory
RPCs and registry (``shm``).

May import: ``contract``, ``lifecycle``, grpc and the generated protos; never
``poolcore``, ``inference`` or numpy (the router never parses tensors).
"""
