"""The pool core: zygote, workers, frames, dispatcher, respawn and the fleet of workers. Runs in
the pool server and in WorkerPool's host; imports contract and lifecycle, never grpc, protobuf,
the generated protos or the inference folder.
"""
