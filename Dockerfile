# streampack service image: one image for the producer, the pack workers and example
# consumers; the role is the subcommand (`docker run IMAGE produce ...`).
#
# BASE_IMAGE only needs `python3` with the `venv` module (Debian's python3-venv), so
# the same file builds on the official slim image and on a Debian base made locally
# with debootstrap where no image registry is reachable (deploy/test-docker.sh).
#
# Instructions are few and ordered with copy-based storage drivers (vfs) in mind: every
# step copies the whole filesystem below it, so metadata comes before the venv copy.
ARG BASE_IMAGE=python:3.12-slim

# ---- builder: turn the source tree into a wheel and install it into /opt/venv ----
FROM ${BASE_IMAGE} AS builder

# Package-index settings for pip, forwarded from the build host by deploy/test-docker.sh.
# They exist only in this stage, which is not part of the final image.
ARG PIP_INDEX_URL PIP_EXTRA_INDEX_URL PIP_TRUSTED_HOST PIP_CERT
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PIP_DEFAULT_TIMEOUT=180

# The context is an allow-list (.dockerignore): packaging metadata, the two packages,
# the worked-example data files the wheel installs, and the warm-up script.
COPY . /src

# The project goes in as a wheel, never as a source checkout: what runs in the
# container is exactly what `pip install streampack` gives.
RUN python3 -m venv /opt/venv \
    && /opt/venv/bin/python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels /src \
    && /opt/venv/bin/python -m pip install --no-cache-dir /wheels/streampack-*.whl \
    && install -D -m 644 /src/deploy/warmup.py /opt/venv/share/streampack/warmup.py \
    && /opt/venv/bin/streampack --help > /dev/null

# ---- runtime: the venv, an unprivileged user and a warm Numba cache ----
FROM ${BASE_IMAGE} AS runtime

# Numba keys its on-disk cache by CPU name and features. "generic" makes the kernels
# compiled here valid on every x86-64 host the image is pulled to, so containers start
# warm anywhere; pass --build-arg NUMBA_CPU_NAME=<llvm cpu name> (e.g. skylake-avx512)
# to tune for one fleet instead.
ARG NUMBA_CPU_NAME=generic

ENV PATH=/opt/venv/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    NUMBA_CACHE_DIR=/var/cache/streampack/numba \
    NUMBA_CPU_NAME=${NUMBA_CPU_NAME} \
    STREAMPACK_HEALTH_ENDPOINT=tcp://127.0.0.1:5556

RUN groupadd --gid 10001 streampack \
    && useradd --uid 10001 --gid streampack --no-create-home \
       --home-dir /var/lib/streampack --shell /usr/sbin/nologin streampack \
    && mkdir -p /var/lib/streampack /var/cache/streampack/numba /data \
    && chown -R streampack:streampack /var/lib/streampack /var/cache/streampack /data

WORKDIR /var/lib/streampack
# Numeric, so that Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
USER 10001:10001
EXPOSE 5555 5556

# Asks a producer whether it is serving: the container's own by default; a worker or
# consumer container sets STREAMPACK_HEALTH_ENDPOINT to its producer's consumer endpoint,
# and STREAMPACK_CURVE_SERVER_KEY to the producer's public key when it uses CURVE.
HEALTHCHECK --interval=15s --timeout=10s --start-period=60s --retries=3 \
    CMD ["/bin/sh", "-c", "set -- --connect \"$STREAMPACK_HEALTH_ENDPOINT\" --timeout 5; if [ -n \"$STREAMPACK_CURVE_SERVER_KEY\" ]; then set -- \"$@\" --curve-server-key \"$STREAMPACK_CURVE_SERVER_KEY\"; fi; exec streampack health \"$@\""]

# Exec form: streampack is PID 1 and receives SIGTERM itself (every role handles it).
ENTRYPOINT ["streampack"]
CMD ["--help"]

COPY --from=builder /opt/venv /opt/venv

# Compile every cached kernel now, as the runtime user, against the installed files the
# container will run: Numba's cache is keyed by source path and modification time, so
# only a warm-up in this stage (not in the builder) is hit at run time.
RUN python /opt/venv/share/streampack/warmup.py

# Last, so that a new revision label does not invalidate the warm-up layer above.
ARG VERSION=dev REVISION=unknown
LABEL org.opencontainers.image.title="streampack" \
      org.opencontainers.image.description="Streaming sequence packing service: producer, pack workers, consumers" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
