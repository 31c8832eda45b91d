"""WorkerPool: pre-forked scoring inside your own process, on the pool core. Never grpc or
protobuf; its zygote is `python -m poolserve.service.workerpool.scoring`.
"""
