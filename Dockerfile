# Shardwise: one image for the operator, the profiling pods and the workers.
#
#   docker build -t ghcr.io/shardwise/shardwise:0.1.0 .                              # CPU (default)
#   docker build --build-arg VARIANT=gpu -t ghcr.io/shardwise/shardwise:0.1.0-gpu .  # CUDA
#   make image          # CPU, with buildah on a debootstrap'd Debian bookworm base, no Docker
#
# The entrypoint is `shardwise` (`shardwise operator`, `shardwise profile …`). Worker
# pods replace it with the launcher (`shardwise-launch`, i.e. `python -m
# shardwise.runtime.launch`, torchrun that exits 0 after a SIGTERM checkpoint)
# running the trainer module `-m shardwise.runtime.train`. /app/examples holds the
# example of training a model of one's own with the runtime.
#
# VARIANT=cpu: torch 2.13.0 (CPU build) and fbgemm-gpu-cpu 1.8.0, what `make setup`
# installs. VARIANT=gpu: torch 2.13.0 and fbgemm-gpu 1.8.0 built for CUDA, from the
# PyTorch index (CUDA_INDEX); the CUDA libraries come as the nvidia-* wheels torch
# pins, so the base stays the slim Python image (the driver comes from the node).
# torchrec 1.8.0 is installed with --no-deps in both, as the Makefile does (its
# metadata would pull the CUDA fbgemm-gpu over fbgemm-gpu-cpu).
#
# Build arguments, each defaulting to the official source:
#   BASE           the base image of both stages: Python 3.11 on Debian bookworm, with
#                  `python` on PATH (scripts/build-image.sh passes a debootstrap'd
#                  bookworm with Debian's python3, also 3.11);
#   CPU_INDEX      where the CPU torch wheel (torch==2.13.0+cpu) comes from;
#   CUDA_INDEX     where the CUDA torch and fbgemm-gpu wheels come from;
#   PIP_INDEX_URL  the index of everything else (a PyPI mirror, say).
#
# Every Python dependency is pinned (==): the closure of `shardwise`'s dependencies
# for Python 3.11 on linux/amd64, checked by tests/test_dockerfile.py against
# pyproject.toml. The default base image is pinned by tag and digest (refresh both
# together: `docker buildx imagetools inspect python:3.11.14-slim-bookworm`).

ARG BASE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

FROM ${BASE} AS build

ARG VARIANT=cpu
ARG CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG CUDA_INDEX=https://download.pytorch.org/whl/cu130
ARG PIP_INDEX_URL=https://pypi.org/simple
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PATH=/opt/shardwise/bin:$PATH

RUN python -m venv /opt/shardwise \
    && pip install pip==26.3 setuptools==84.2.1

# torch and the FBGEMM kernels of the variant, without dependencies (pinned below). The
# CPU pin names the local version (+cpu): no other index can slip a CUDA build in.
RUN set -eu; \
    case "$VARIANT" in \
      cpu) pip install --no-deps --index-url "$CPU_INDEX" torch==2.13.0+cpu \
           && pip install --no-deps fbgemm-gpu-cpu==1.8.0 ;; \
      gpu) pip install --no-deps --index-url "$CUDA_INDEX" torch==2.13.0 fbgemm-gpu==1.8.0 ;; \
      *) echo "VARIANT must be cpu or gpu, not '$VARIANT'" >&2; exit 1 ;; \
    esac

# Everything else from PyPI (PIP_INDEX_URL), every package pinned; torch's own
# requirements resolve against the build installed above (for gpu: the nvidia-* wheels
# it pins exactly).
RUN pip install \
      torch==2.13.0 \
      aiohappyeyeballs==2.7.1 \
      aiohttp==3.14.5 \
      aiohttp-retry==2.9.1 \
      aiosignal==1.4.0 \
      annotated-doc==0.0.7 \
      annotated-types==0.8.0 \
      attrs==26.1.0 \
      certifi==2026.10.18 \
      charset-normalizer==3.5.2 \
      click==8.5.1 \
      cloudpickle==3.1.2 \
      contourpy==1.3.3 \
      cycler==0.12.1 \
      durationpy==0.11 \
      filelock==4.2.11 \
      fonttools==4.68.0 \
      frozenlist==1.8.0 \
      fsspec==2026.9.0 \
      idna==3.20 \
      iso8601==2.1.0 \
      jinja2==3.1.6 \
      jsonpatch==1.47 \
      jsonpointer==3.12 \
      kiwisolver==1.5.1 \
      kopf==1.45.2 \
      kubernetes==37.0.2 \
      lightning-utilities==0.15.3 \
      markdown-it-py==4.3.0 \
      markupsafe==3.0.4 \
      matplotlib==3.11.2 \
      mdurl==0.1.2 \
      mpmath==1.3.0 \
      multidict==7.2.1 \
      mypy-extensions==1.2.0 \
      networkx==3.6.1 \
      numpy==2.4.6 \
      oauthlib==4.0.1 \
      packaging==26.3 \
      pillow==13.0.0 \
      prometheus-client==0.26.0 \
      propcache==0.5.4 \
      pydantic==2.14.3 \
      pydantic-core==2.50.4 \
      pygments==2.21.0 \
      pyparsing==3.3.3 \
      pyre-extensions==0.0.32 \
      python-dateutil==4.0.0 \
      python-json-logger==4.2.0 \
      pyvers==0.2.3 \
      pyyaml==6.0.3 \
      requests==2.34.2 \
      requests-oauthlib==2.0.0 \
      rich==15.0.0 \
      shellingham==1.5.4 \
      sympy==1.14.0 \
      tensordict==0.15.3 \
      torchmetrics==1.0.3 \
      tqdm==4.70.1 \
      typer==0.29.2 \
      typing-extensions==4.16.0 \
      typing-inspect==0.9.0 \
      typing-inspection==0.4.5 \
      tzdata==2026.6 \
      urllib3==2.8.0 \
      websocket-client==1.9.2 \
      yarl==1.25.1 \
    && pip check \
    && pip install --no-deps torchrec==1.8.0

# The project itself (pure Python; src/shardwise/{planner,profiler,runtime,operator}
# link to the top-level folders, which setuptools follows).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
COPY planner ./planner
COPY profiler ./profiler
COPY runtime ./runtime
COPY operator ./operator
RUN pip install --no-deps --no-build-isolation . \
    && shardwise --help >/dev/null \
    && if [ "$VARIANT" = cpu ]; then python -c "import torchrec, fbgemm_gpu, shardwise.runtime.trainer"; fi


FROM ${BASE} AS runtime

ARG VARIANT=cpu
LABEL org.opencontainers.image.title="shardwise" \
      org.opencontainers.image.description="Shardwise operator, profiler and TorchRec worker (${VARIANT})" \
      org.opencontainers.image.licenses="Apache-2.0" \
      dev.shardwise.variant="${VARIANT}"

# No compilers or build tools here: the virtual environment comes ready-made.
RUN groupadd --system --gid 10001 shardwise \
    && useradd --system --uid 10001 --gid 10001 --home-dir /home/shardwise --create-home \
       --shell /usr/sbin/nologin shardwise
COPY --from=build /opt/shardwise /opt/shardwise
COPY examples /app/examples

ENV PATH=/opt/shardwise/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/home/shardwise \
    MPLCONFIGDIR=/tmp/matplotlib
WORKDIR /app
USER 10001:10001
ENTRYPOINT ["shardwise"]
CMD ["--help"]
