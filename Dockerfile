# kvcached sidecar image (first version; the operations work finishes it).
# CUDA base with PyTorch; the daemon runs as a non-root user.
FROM pytorch/pytorch:2.4.1-cuda12.4-cudnn9-runtime
WORKDIR /opt/kvcached
COPY pyproject.toml README.md ./
COPY kvcached ./kvcached
COPY client ./client
COPY proto ./proto
RUN pip install --no-cache-dir . \
 && useradd --create-home --uid 1000 kvcached \
 && mkdir -p /run/kvcached && chown kvcached /run/kvcached && chmod 0700 /run/kvcached
USER kvcached
ENV KVCACHED_RUN_DIR=/run/kvcached
HEALTHCHECK --interval=10s --timeout=5s --retries=3 CMD ["kvcached", "status", "--run-dir", "/run/kvcached"]
ENTRYPOINT ["kvcached", "serve", "--run-dir", "/run/kvcached"]
CMD ["--device", "cuda:0", "--host-cache-gb", "16"]
