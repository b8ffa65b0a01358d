# One image for every inferlb component. The model is converted at build time,
# so containers start without touching the network.
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY workers ./workers
COPY control_plane ./control_plane
COPY ext_proc ./ext_proc
COPY inferlb ./inferlb
RUN python -m venv /opt/inferlb \
 && /opt/inferlb/bin/pip install --no-cache-dir --no-deps "$(sed -n 's/^model = \["\(.*\)"\]/\1/p' pyproject.toml)" \
 && /opt/inferlb/bin/pip install --no-cache-dir .
ENV INFERLB_DATA_DIR=/var/lib/inferlb
RUN /opt/inferlb/bin/python -m workers prepare

FROM python:3.11-slim
RUN useradd --system --uid 10001 --home-dir /var/lib/inferlb inferlb
COPY --from=build /opt/inferlb /opt/inferlb
COPY --from=build --chown=inferlb /var/lib/inferlb /var/lib/inferlb
ENV PATH=/opt/inferlb/bin:$PATH INFERLB_DATA_DIR=/var/lib/inferlb
USER inferlb
EXPOSE 8101
CMD ["python", "-m", "workers", "--host", "0.0.0.0", "--port", "8101"]
