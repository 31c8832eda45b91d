"""What the router and the pool server share as gRPC servers: errors to statuses, guarded handlers,
health, tracing, private sockets, model-control pacing. Never the pool core or the inference
folder.
"""
