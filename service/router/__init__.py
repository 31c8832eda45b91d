"""The ``poolserve router`` process (``main``, ``router``), the one door
clients see: the route table and every pool's health (``routes``), one
forwarding core with the remaining deadline, the trace span and the lane
(``forwarding``, over ``lane_client``), one module per door (``grpc_door``;
``http_door`` with ``http_connection``, ``http_wire`` and ``http_control``;
MLServer's repository service, ``model_repository``), the calls both doors
make alike (``repository``), and the bounds on what slow clients hold
(``replybudget``) and each connection's calls in flight (``streams``).

May import: ``grpcserver``, ``contract``, ``lifecycle``; never ``poolcore``,
``inference`` or numpy (it never parses tensors), nor another door.
"""
