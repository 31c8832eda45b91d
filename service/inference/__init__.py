"""One inference on one model: the model API that runtimes implement
(``model``), the tensor codec between the Open Inference Protocol and numpy
(``codec``), one request in and one response out (``infer``), a model's
warm-up input (``warmup``), shared-memory tensors read and written in place
(``shm``), and the pool server's cargo: what its zygote loads
and its workers run (``cargo``; ``spawned`` for ``start_method: spawn``).

May import: ``poolcore``, ``contract``, ``lifecycle``, numpy and the
generated protos; never grpc.
"""
