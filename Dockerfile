# Quiver's SageMaker image: `serve` on the PATH, the SageMaker listener on port 8080, as
# Triton's SageMaker image. Build and run it as the README's "SageMaker" section shows:
#   docker build -t quiver-sagemaker .
#   docker run --rm -p 8080:8080 -v "$PWD/model_repository:/opt/ml/model:ro" \
#       -e SAGEMAKER_TRITON_DEFAULT_MODEL_NAME=text_pipeline quiver-sagemaker serve
# QUIVER_EXTRAS picks the backends beside ONNX Runtime and Python (always in): the default
# serves the seed's pipelines (TorchScript, TensorFlow, DALI); pass "" for the smallest image.
FROM python:3.11-slim

ARG QUIVER_EXTRAS=torch,tensorflow,dali
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    QUIVER_CACHE_DIR=/tmp/quiver-model-cache

WORKDIR /opt/quiver
COPY pyproject.toml README.md ./
COPY src ./src
RUN if [ -n "$QUIVER_EXTRAS" ]; then pip install ".[$QUIVER_EXTRAS]"; else pip install .; fi \
    && rm -rf /root/.cache
COPY docker/sagemaker/serve /usr/local/bin/serve
RUN chmod 0755 /usr/local/bin/serve && mkdir -p /opt/ml/model /opt/ml/models

# SageMaker sends requests to port 8080 (SAGEMAKER_BIND_TO_PORT moves it).
EXPOSE 8080
WORKDIR /opt/ml
CMD ["serve"]
