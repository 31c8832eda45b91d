"""The ``poolserve router`` process (``main``, ``router``), the one door
clients see: it routes by model name, forwards bytes over each pool's lane
with the remaining deadline (``lane_client``), follows every pool's health, and bounds what slow
clients hold (``replybudget``) and each connection's calls in flight (``streams``).

May import: ``grpcserver``, ``contract``, ``lifecycle``; never ``poolcore``,
``inference`` or numpy (it never parses tensors), nor another door.
"""
