"""What every process agrees on: settings, the model repository, errors (without their gRPC codes),
the wire formats and the run directory. Imports only the standard library and itself.
"""
