# llm-continuity-gateway: build with `docker build -t llm-continuity-gateway .` (or podman).
# BASE_IMAGE must be Debian-like with python3 (>= 3.11) and its venv module; the official slim
# image is the default. scripts/image-smoke builds one from Debian's packages instead.
ARG BASE_IMAGE=docker.io/library/python:3.12-slim-bookworm

# -- build: a virtualenv with the gateway and its runtime dependencies ---------------------------
FROM ${BASE_IMAGE} AS build
# EXTRAS=litellm adds kind = "litellm" providers (Anthropic, Gemini, Bedrock, ...), ~240 MB;
# EXTRAS=tracing the OpenTelemetry SDK for [tracing]; EXTRAS=litellm,tracing both.
ARG EXTRAS=""
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_ROOT_USER_ACTION=ignore
RUN python3 -m venv /opt/gateway
WORKDIR /src
COPY pyproject.toml README.md ./
COPY gateway ./gateway
RUN /opt/gateway/bin/pip install ".${EXTRAS:+[$EXTRAS]}" \
    && /opt/gateway/bin/pip uninstall -y pip \
    && find /opt/gateway -name __pycache__ -prune -exec rm -rf {} +

# -- runtime: the virtualenv, a config, a non-root user, a volume for the data --------------------
FROM ${BASE_IMAGE}
RUN groupadd --gid 10001 gateway \
    && useradd --uid 10001 --gid gateway --home-dir /data --no-create-home --no-log-init \
       --shell /usr/sbin/nologin gateway \
    && mkdir -p /data /etc/gateway \
    && chown gateway:gateway /data
COPY --from=build /opt/gateway /opt/gateway
COPY config/gateway.toml /etc/gateway/gateway.toml
# The shipped config, listening on every interface of the container, data in the volume.
# Any key can be overridden with GATEWAY_<SECTION>__<KEY> (see docs/configuration.md).
ENV PATH=/opt/gateway/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    GATEWAY_CONFIG=/etc/gateway/gateway.toml \
    GATEWAY_SERVER__HOST=0.0.0.0 \
    GATEWAY_SERVER__PORT=8080 \
    GATEWAY_STORAGE__DATA_DIR=/data
USER gateway
WORKDIR /data
VOLUME ["/data"]
EXPOSE 8080
HEALTHCHECK --interval=15s --timeout=5s --start-period=20s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request as u; u.build_opener(u.ProxyHandler({})).open('http://127.0.0.1:%s/readyz' % os.environ.get('GATEWAY_SERVER__PORT', '8080'), timeout=4)"]
ENTRYPOINT ["gateway"]
CMD ["serve"]
