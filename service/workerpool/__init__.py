"""WorkerPool, the library: the pool core inside your own process, with
``score()`` calls instead of gRPC (``pool``, the public face; the path of
one call in ``calls``; zygote, dispatcher, fleet, start and shutdown in
``runtime``; its models in ``models``, its counters and status in
``status``, the bridge to its event loop in ``loop``). Its cargo
(``scoring``) runs your pickled ``load``/``score`` functions in a zygote
started as ``python -m poolserve.service.workerpool.scoring``; ``payload``
moves large arrays through shared memory.

May import: ``poolcore``, ``contract``, ``lifecycle``; never grpc, protobuf,
the generated protos or ``inference``. This file imports nothing, so that the
zygote's ``python -m`` starts light.
"""
