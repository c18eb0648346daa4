# A generator replica on the embedded transformers+PEFT engine, on a CUDA GPU.
# For SGLang-backed replicas use generator-sglang.Dockerfile.
# Build from the repository root: docker build -f ops/docker/generator.Dockerfile -t rollwire-generator .
FROM pytorch/pytorch:2.9.1-cuda12.8-cudnn9-runtime
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY client ./client
COPY server ./server
COPY learner ./learner
# torch comes from the base image; the constraints pin everything else.
RUN grep -v '^torch' constraints.txt > /tmp/c.txt && pip install --no-cache-dir -c /tmp/c.txt '.[model]' \
 && rm -rf /src /tmp/c.txt
# Run as an unprivileged user with a fixed uid/gid (10001), so Kubernetes' runAsNonRoot can
# check it; it owns only its home (caches) and /var/lib/rollwire (scratch).
RUN groupadd --gid 10001 rollwire \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/rollwire --shell /usr/sbin/nologin rollwire \
 && install -d -o 10001 -g 10001 -m 0750 /var/lib/rollwire
WORKDIR /home/rollwire
ENV HOME=/home/rollwire
USER 10001:10001
EXPOSE 50051 9400 8081
ENTRYPOINT ["rollwire"]
CMD ["generator", "--config", "/etc/rollwire/generator.toml"]
