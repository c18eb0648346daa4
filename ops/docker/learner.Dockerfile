# The learner. CPU torch by default (TORCH_SPEC=torch==2.13.0); for a GPU learner build with
# --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu128 (or start FROM a CUDA image).
# Build from the repository root: docker build -f ops/docker/learner.Dockerfile -t rollwire-learner .
FROM python:3.11-slim
ARG TORCH_SPEC=torch==2.13.0
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
WORKDIR /src
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "$TORCH_SPEC"
COPY pyproject.toml README.md constraints.txt ./
COPY client ./client
COPY server ./server
COPY learner ./learner
RUN pip install --no-cache-dir -c constraints.txt '.[model]' && rm -rf /src
# Run as an unprivileged user with a fixed uid/gid (10001), so Kubernetes' runAsNonRoot can
# check it; it owns only its home (caches) and /var/lib/rollwire (checkpoints: mount the run_dir volume there).
RUN groupadd --gid 10001 rollwire \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/rollwire --shell /usr/sbin/nologin rollwire \
 && install -d -o 10001 -g 10001 -m 0750 /var/lib/rollwire
WORKDIR /home/rollwire
ENV HOME=/home/rollwire
USER 10001:10001
EXPOSE 9400
ENTRYPOINT ["rollwire"]
CMD ["learner", "--config", "/etc/rollwire/learner.toml"]
