"""The `poolserve pool` process: the gRPC servicer, the lane server, inline models and live model
control over the pool core (and `serve-inprocess`).
"""
