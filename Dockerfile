# One image for every pagedserve process; docker-compose.yml picks the role by command.
# A CUDA runtime base (the driver comes from the host through the NVIDIA container toolkit), with
# gcc and Python's headers: Triton builds its kernel launcher with a C compiler at first use.
# torch is its CUDA wheel from PyTorch's index (the wheel carries the CUDA libraries and pulls the
# Triton it was built with); the same version as pyproject.toml's pin, so `pip install -e .` keeps it.
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}
RUN apt-get update && apt-get install -y --no-install-recommends \
        python3 python3-venv python3-dev gcc libc6-dev curl \
    && rm -rf /var/lib/apt/lists/*
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN python3 -m venv /opt/venv
WORKDIR /app
COPY pyproject.toml README.md requirements.lock ./
COPY pagedserve pagedserve
COPY services services
COPY kvstore kvstore
COPY kernels kernels
COPY loadgen loadgen
# A CPU-only image: --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
ARG TORCH_SPEC=torch==2.13.0
# torch from its index, everything else at the lock's tested versions (the lock's torch is the CPU
# build), then our package alone (one import name: pagedserve).
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "$TORCH_SPEC" \
    && grep -v '^torch==' requirements.lock > /tmp/lock.txt && pip install --no-cache-dir -r /tmp/lock.txt \
    && pip install --no-cache-dir --no-deps --no-build-isolation -e .
ENV HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
# The tiny demo model is built into the image so the stack starts with no model mounted.
RUN pagedserve tiny-model /models/tiny --arch llama
ENTRYPOINT ["pagedserve"]
