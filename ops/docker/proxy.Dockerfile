# The routing proxy: CPU only; rollwire's base install has no torch.
# Build from the repository root: docker build -f ops/docker/proxy.Dockerfile -t rollwire-proxy .
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md constraints.txt ./
COPY client ./client
COPY server ./server
COPY learner ./learner
RUN pip install --no-cache-dir -c constraints.txt . && rm -rf /src
USER 65534
EXPOSE 50050 9400
ENTRYPOINT ["rollwire"]
CMD ["proxy", "--config", "/etc/rollwire/proxy.toml"]
