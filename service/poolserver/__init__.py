"""The ``poolserve pool`` process (``main``, ``server``): start-up order (zygote
first, then gRPC), the Open Inference Protocol servicer over a catalog
(``servicer``, ``catalog``, ``metadata``, ``statistics``), live model load and
unload (``model_control``, ``load_request``), inline models (``inline``), the
pool's end of the lane (``lane_server``); and ``serve-inprocess``, the same
servicer without workers (``inprocess``).

May import: every lower layer (``grpcserver``, ``inference``, ``poolcore``,
``contract``, ``lifecycle``); never another door (``router``, ``workerpool``).
"""
