"""The data plane: settings and repository, codec, runtime API, workers, pools, router."""
