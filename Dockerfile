# oxygen_torch on a CUDA 12 machine. Build: docker build -t oxygen-torch .
# Run:   docker run --rm --gpus all oxygen-torch                 (prints `doctor`)
#        docker run --rm --gpus all -p 9400:9400 oxygen-torch python my_server.py
# The native library opens the host's libcuda.so.1 (mounted by the NVIDIA container toolkit) at
# run time: no LD_PRELOAD, no sysctl, no privileged mode.
# The base supplies the CUDA 12 user-space set-up the NVIDIA container toolkit expects;
# oxygen_torch itself needs only the driver.
FROM nvidia/cuda:12.4.1-runtime-ubuntu22.04

# torch wheels carry their own CUDA libraries; pick an index whose CUDA version the host driver
# supports (cu128 needs a driver for CUDA >= 12.8; .../cu130 wants a CUDA 13 driver).
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128

ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    PATH=/opt/venv/bin:$PATH

# g++ builds the native pool (plain C++17; cuda.h comes from the nvidia-cuda-runtime-cu12 wheel).
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev g++ \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv \
    && pip install --upgrade pip \
    && pip install --index-url "$TORCH_INDEX_URL" "torch>=2.11"

WORKDIR /opt/oxygen_torch
COPY . .
RUN pip install ".[hf,ops]"

WORKDIR /workspace
# The metrics endpoint (oxygen_torch.tools.metrics.start_http_server). It binds 127.0.0.1 unless the
# program passes addr="0.0.0.0": do that inside a container so `-p 9400:9400` can reach it.
EXPOSE 9400
CMD ["python", "-m", "oxygen_torch", "doctor"]
