# kvcached sidecar image: a CUDA base with PyTorch, the daemon as a non-root user.
#   docker build -t kvcached .
#   docker run --gpus '"device=0"' --ipc host -v kvcached-run:/run/kvcached \
#     -v /var/cache/kvcached:/var/cache/kvcached -p 127.0.0.1:9400:9400 kvcached \
#     --device cuda:0 --host-cache-gb 64 --storage 'disk:///var/cache/kvcached?capacity_gb=500' \
#     --metrics-port 9400 --metrics-addr 0.0.0.0
# --ipc host: CUDA IPC handles and the /dev/shm signal segment must be shared with the engine.
# The distribution (kvcached-sidecar) compiles two small C extensions (the daemon's SIGBUS guard and
# its native CPU copies):
# its wheel is built in the devel image, which has a compiler, and installed in the runtime one.
FROM pytorch/pytorch:2.4.1-cuda12.4-cudnn9-devel AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kvcached ./kvcached
COPY client ./client
COPY proto ./proto
RUN pip wheel --no-cache-dir --no-deps -w /wheels .

FROM pytorch/pytorch:2.4.1-cuda12.4-cudnn9-runtime
COPY --from=build /wheels /wheels
# torch comes with the base image (>= 2.4 satisfies the requirement): pip adds only the rest
RUN pip install --no-cache-dir /wheels/*.whl "redis>=5.0" && rm -rf /wheels \
 && useradd --create-home --uid 1000 kvcached \
 && mkdir -p /run/kvcached /var/cache/kvcached \
 && chown kvcached /run/kvcached /var/cache/kvcached && chmod 0700 /run/kvcached

USER kvcached
ENV KVCACHED_RUN_DIR=/run/kvcached \
    KVCACHED_LOG_FORMAT=json
VOLUME ["/run/kvcached", "/var/cache/kvcached"]
EXPOSE 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
  CMD ["kvcached", "status", "--timeout", "3"]
ENTRYPOINT ["kvcached", "serve"]
CMD ["--device", "cuda:0", "--host-cache-gb", "16"]
