# A generator replica on the sglang engine: rollwire launches SGLang inside this container
# (same GPU, same disk for pushed adapters) and serves GeneratorService in front of it.
# Based on SGLang's official image, at the SGLang release rollwire was written against.
# Build from the repository root:
#   docker build -f ops/docker/generator-sglang.Dockerfile -t rollwire-generator-sglang .
# Run on a GPU host (docs/engines.md has the whole recipe):
#   docker run --gpus all --shm-size 16g -p 50051:50051 -p 9400:9400 -v /models:/models \
#     rollwire-generator-sglang generator --engine sglang --model /models/Qwen2.5-0.5B --host 0.0.0.0
FROM lmsysorg/sglang:v0.5.23
WORKDIR /src
COPY pyproject.toml README.md ./
COPY client ./client
COPY server ./server
COPY learner ./learner
# SGLang, torch and transformers come from the base image; the `sglang` extra pins the same
# SGLang, so pip keeps them and adds only rollwire's gRPC stack and its HTTP client.
# The CPU constraints file is not used here: it pins a different torch and transformers.
RUN pip install --no-cache-dir '.[sglang]' && rm -rf /src
# Run as an unprivileged user with a fixed uid/gid (10001), so Kubernetes' runAsNonRoot can
# check it; it owns only its home (caches) and /var/lib/rollwire (pushed adapters).
RUN groupadd --gid 10001 rollwire \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/rollwire --shell /usr/sbin/nologin rollwire \
 && install -d -o 10001 -g 10001 -m 0750 /var/lib/rollwire /var/lib/rollwire/adapters
WORKDIR /home/rollwire
# Pushed adapters are written here; mount a volume to keep them on the host's disk.
VOLUME /var/lib/rollwire
ENV HOME=/home/rollwire
USER 10001:10001
EXPOSE 50051 9400
ENTRYPOINT ["rollwire"]
CMD ["generator", "--engine", "sglang", "--config", "/etc/rollwire/generator.toml", \
     "--set", "sglang.adapter_dir=/var/lib/rollwire/adapters"]
