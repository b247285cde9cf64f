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
# The paddle extra is the CPU build; for GPUs, install paddlepaddle-gpu from Paddle's index.
# The tiny model is made once, at build time, so every container serves the same weights.
RUN pip install ".[paddle]" \
    && splitbus make-tiny-model /opt/splitbus/models/tiny --seed 0

USER splitbus
EXPOSE 8000 9100
ENTRYPOINT ["splitbus"]
