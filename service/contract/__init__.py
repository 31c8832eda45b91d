"""What every poolserve process agrees on: settings and where each value comes
from (``settings``), the model repository (``repository``, ``schedule``), the
errors as values without any transport (``errors``), the one frame codec of
every byte stream (``framing``), the lane's frames between router and pool
(``lane``), the peek at a request's model name in its wire bytes (``wire``),
a shared-memory registration and how a request carries it (``shm``), the run
directory and its sockets (``rundir``).

May import: the standard library only (no numpy, no protobuf, no grpc, nothing
of poolserve's processes), so the supervisor and the router carry none of them.
"""
