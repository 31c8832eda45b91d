# syntax=docker/dockerfile:1
# poolserve container image: slim Python, the project in a virtual
# environment, a non-root user, tini as PID 1 (it forwards SIGTERM to
# `poolserve serve`, which stops the router, drains, then stops the pools;
# tini reaps whatever else gets reparented to PID 1).
#
#   docker build -t poolserve:0.1.0 .
#   docker run --rm -p 8081:8081 -p 8080:8080 -v "$PWD/models:/models:ro" poolserve:0.1.0
#   docker stop --time 90 CONTAINER   # above poolserve's own stop bound
#
# Build argument EXTRAS: optional dependencies (default sklearn, for the
# built-in scikit-learn runtime); pass --build-arg EXTRAS= for none.
ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim AS build
ARG EXTRAS=sklearn
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY protos/ protos/
COPY service/ service/
COPY supervisor/ supervisor/
RUN python -m venv /opt/poolserve \
 && /opt/poolserve/bin/pip install ".${EXTRAS:+[$EXTRAS]}"

FROM python:${PYTHON_VERSION}-slim
RUN apt-get update \
 && apt-get install -y --no-install-recommends tini \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 poolserve \
 && useradd --system --uid 10001 --gid poolserve --no-create-home \
    --home-dir /nonexistent --shell /usr/sbin/nologin poolserve
COPY --from=build /opt/poolserve /opt/poolserve
# A default repository with one model, so the image serves out of the box;
# mount yours over /models.
COPY examples/models/echo/ /models/echo/
ENV PATH=/opt/poolserve/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    POOLSERVE_HOST=0.0.0.0 \
    POOLSERVE_GRPC_PORT=8081 \
    POOLSERVE_RUN_DIR=/tmp/poolserve \
    POOLSERVE_LOG_FORMAT=json
USER 10001:10001
WORKDIR /
EXPOSE 8081 8080
STOPSIGNAL SIGTERM
# Healthy once every model is loaded and serving (exit 0); any non-zero
# code (see `poolserve probe --help`) counts as a failed check.
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["/opt/poolserve/bin/poolserve", "probe", "--addr", "127.0.0.1:8081", "--rpc-timeout", "3"]
ENTRYPOINT ["/usr/bin/tini", "--", "/opt/poolserve/bin/poolserve"]
CMD ["serve", "/models"]
