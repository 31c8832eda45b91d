"""One inference on one model: the model API, the tensor codec, and the pool server's cargo that
zygotes load and workers run. numpy and protobuf, never grpc.
"""
