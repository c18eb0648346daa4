# The routing proxy: CPU only; rollwire's base install has no torch.
# Build from the repository root: docker build -f ops/docker/proxy.Dockerfile -t rollwire-proxy .
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY client ./client
COPY server ./server
COPY learner ./learner
RUN pip install --no-cache-dir -c constraints.txt . && rm -rf /src
# Run as an unprivileged user with a fixed uid/gid (10001), so Kubernetes' runAsNonRoot can
# check it; it owns only its home (caches) and /var/lib/rollwire (the adapter spool).
RUN groupadd --gid 10001 rollwire \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/rollwire --shell /usr/sbin/nologin rollwire \
 && install -d -o 10001 -g 10001 -m 0750 /var/lib/rollwire /var/lib/rollwire/spool
WORKDIR /home/rollwire
ENV HOME=/home/rollwire
USER 10001:10001
EXPOSE 50050 9400
ENTRYPOINT ["rollwire"]
CMD ["proxy", "--config", "/etc/rollwire/proxy.toml"]
