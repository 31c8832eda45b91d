"""The pool core, one for both doors (the pool server and WorkerPool): the
zygote process and its ``Cargo`` protocol (``zygote``), the pool's end of it
(``zygote_control``), workers and their frames (``worker``, ``frames``), the
dispatcher that coordinates the queue and which job runs on which worker
(``dispatcher``) and its parts, each the one owner of its state
(``admission`` and ``jobqueue``, ``batches``, ``watch``, ``deaths``,
``streams``, ``roster``, ``link``, ``jobs``; a part never imports the
dispatcher), the rolling replacement and worker deaths of both doors
(``fleet``), crash back-off (``respawn``), counters (``stats``), native
thread limits (``threads``). It moves opaque bytes and knows nothing of
gRPC or of models.

May import: ``contract`` and ``lifecycle``; never grpc, protobuf, the
generated protos or ``inference`` (import-linter checks it, and a test checks
a live WorkerPool zygote's ``sys.modules``).
"""
