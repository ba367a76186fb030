# handoff-decode: the decode worker as a static binary on an empty base.
# Built by scripts/images from a context it prepares (the binary plus an empty
# tmp/ directory); nothing is pulled from a registry.
FROM scratch
ARG VERSION=dev
ARG REVISION=unknown
LABEL org.opencontainers.image.title="handoff-decode" \
      org.opencontainers.image.description="handoff decode worker: OpenAI-compatible API; receives KV blocks and Mamba state rows from prefill workers" \
      org.opencontainers.image.source="https://github.com/handoff-io/handoff" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}"
COPY --chown=65532:65532 tmp /tmp
COPY decode /decode
USER 65532:65532
ENV TMPDIR=/tmp
# OpenAI API, data plane (TCP listener of the rdma engine), admin (/livez /readyz /metrics)
EXPOSE 8000 7400 9091
STOPSIGNAL SIGTERM
HEALTHCHECK --interval=5s --timeout=3s --start-period=30s --retries=3 CMD ["/decode", "healthcheck"]
ENTRYPOINT ["/decode"]
