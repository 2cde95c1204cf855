# One image for the operator, the router, the llumlet sidecar and the sim engine.
# The engine image for vLLM is the same build on the vLLM release the KV connector is written against
# (llumnix/vllm_support.py; the tag the operator expects by default ends in -vllm<that release>):
#   docker build -t llumnix .
#   docker build -t llumnix-vllm:0.1.0-vllm0.32.0 --build-arg BASE=vllm/vllm-openai:v0.32.0 .
ARG BASE=python:3.11-slim
FROM ${BASE}

# The sources are installed, then removed: a checkout's `operator/` on sys.path would shadow the
# standard library's `operator` module.
COPY pyproject.toml setup.py README.md /tmp/build/
COPY llumnix /tmp/build/llumnix
COPY llumlet /tmp/build/llumlet
COPY operator /tmp/build/operator
# kopf and kubernetes (the operator) are pinned as in the dev extra; the tokenizer extra is the router's
# (prefix-aware dispatch of text and chat prompts).
RUN pip install --no-cache-dir "/tmp/build[tokenizer]" kopf==1.45.2 kubernetes==37.0.2 \
    && rm -rf /tmp/build \
    && (command -v python >/dev/null || ln -s "$(command -v python3)" /usr/local/bin/python)
ENV PYTHONSAFEPATH=1
WORKDIR /home

# Pods set the command (llumnix operator / router / drain-instance, python -m llumlet, ...).
USER 1000
CMD ["llumnix", "--help"]
