# One image for every pagedserve process; docker-compose.yml picks the role by command.
FROM python:3.11-slim
WORKDIR /app
RUN apt-get update && apt-get install -y --no-install-recommends curl && rm -rf /var/lib/apt/lists/*
COPY pyproject.toml README.md ./
COPY services services
COPY kvstore kvstore
COPY kernels kernels
COPY loadgen loadgen
# The CPU build by default; a CUDA host builds with --build-arg TORCH_INDEX=<a CUDA wheel index>.
ARG TORCH_SPEC=torch==2.13.0
RUN pip install --no-cache-dir "$TORCH_SPEC" && pip install --no-cache-dir -e .
ENV HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# The tiny demo model is built into the image so the stack starts with no model mounted.
RUN pagedserve tiny-model /models/tiny --arch llama
ENTRYPOINT ["pagedserve"]
