# The stagetrace demo service for `docker compose --profile demo up`. CPU-only torch keeps the image small.
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md constraints.txt ./
COPY src ./src
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
 && pip install --no-cache-dir -c constraints.txt ".[demo,gpu]"
USER nobody
ENTRYPOINT []
