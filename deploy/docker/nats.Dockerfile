# handoff-nats: nats-server (the Go module this repository pins) with
# JetStream on, as a static binary on an empty base. Built by scripts/images;
# nothing is pulled from a registry. Mount a volume on /data to keep JetStream
# state across restarts; the directory belongs to the image's user so that a
# fresh named volume inherits a writable owner.
FROM scratch
ARG VERSION=dev
ARG REVISION=unknown
LABEL org.opencontainers.image.title="handoff-nats" \
      org.opencontainers.image.description="NATS server with JetStream for handoff's control plane" \
      org.opencontainers.image.source="https://github.com/handoff-io/handoff" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
COPY --chown=65532:65532 tmp /tmp
COPY --chown=65532:65532 data /data
COPY handoff-nats /handoff-nats
USER 65532:65532
ENV TMPDIR=/tmp \
    HANDOFF_NATS_STORE_DIR=/data
VOLUME ["/data"]
# client, monitoring (/healthz), cluster routes
EXPOSE 4222 8222 6222
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=5s --timeout=3s --start-period=20s --retries=3 CMD ["/handoff-nats", "healthcheck"]
ENTRYPOINT ["/handoff-nats"]
