# The image behind `outbox-relay` and `outbox migrate` in docker-compose.yml.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY outbox ./outbox
COPY migrations ./migrations
RUN pip install . && useradd --system --create-home --uid 10001 outbox

USER outbox
WORKDIR /home/outbox
# SIGTERM (docker stop) ends the relay cleanly after the batch in hand.
STOPSIGNAL SIGTERM
CMD ["outbox-relay"]
