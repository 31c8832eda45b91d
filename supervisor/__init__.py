"""The supervision tree and the ``poolserve`` command line."""
