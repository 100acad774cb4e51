#!/usr/bin/env bash
# Install torch (pinned, first) and then this project into the environment of PYTHON.
# The one place that says which torch and from where: scripts/setup.sh (development, CI) and the
# Dockerfile's builder stage both run this script; `--dry-run` prints what it would run.
set -euo pipefail

# The torch every environment of this project gets. The pyproject range (torch>=2.6) is
# satisfied by it, so installing the project afterwards keeps it.
TORCH_VERSION=2.13.0
# PyTorch's own wheel indexes (`--torch-index pytorch`). torch 2.13 is built for CUDA 12.6 and
# 13.0 (13.2 experimental): cu126 runs on the oldest drivers, cu130 adds Blackwell+PTX (pass it
# with --torch-index URL). The CUDA wheels carry their own CUDA runtime (nvidia-* wheels).
PYTORCH_INDEX_CPU=https://download.pytorch.org/whl/cpu
PYTORCH_INDEX_CUDA=https://download.pytorch.org/whl/cu126

usage() {
  cat <<EOF
usage: scripts/install.sh PYTHON [--variant cpu|cuda] [--torch-index URL|pytorch]
                          [--extras LIST] [--editable|--no-editable] [--torch-only]
                          [--tag NAME] [--dry-run]

Installs torch==$TORCH_VERSION first, then this project, with PYTHON's pip.

  PYTHON          the interpreter whose environment gets everything (e.g. .venv/bin/python)
  --variant       cpu (default) or cuda: which torch build
  --torch-index   where torch comes from: a URL, or 'pytorch' for PyTorch's index of the variant
                  (cpu: $PYTORCH_INDEX_CPU, cuda: $PYTORCH_INDEX_CUDA).
                  Default: none for cpu (plain 'pip install torch==$TORCH_VERSION', which on this
                  project's machines takes the local CPU wheel), 'pytorch' for cuda
  --extras        comma-separated extras of the project, e.g. test,bench (default: none)
  --editable      pip install -e (default; development)   --no-editable   a regular install
  --torch-only    install torch and stop (a separate, cacheable image layer)
  --tag NAME      prefix of the progress lines, [NAME] (default: install)
  --dry-run       print the commands of an install into an environment without torch ('+ ...'
                  lines), run nothing
EOF
}

die() {
  echo "install.sh: $*" >&2
  exit 2
}

# a command as one line, arguments with shell characters in single quotes
show() {
  local out="+" arg
  for arg in "$@"; do
    if [[ $arg =~ ^[A-Za-z0-9_./:=+@%-]+$ ]]; then
      out+=" $arg"
    else
      out+=" '$arg'"
    fi
  done
  echo "$out"
}

case "${1:-}" in
  -h | --help)
    usage
    exit 0
    ;;
  "" | -*) usage >&2 && die "the first argument must be PYTHON" ;;
esac
PY=$1
shift
VARIANT=cpu INDEX=unset EXTRAS="" EDITABLE=1 TORCH_ONLY=0 TAG=install DRY_RUN=0
while [ $# -gt 0 ]; do
  case "$1" in
    --variant) VARIANT=${2:?--variant needs cpu or cuda} && shift ;;
    --torch-index) INDEX=${2?--torch-index needs a URL or pytorch} && shift ;;
    --extras) EXTRAS=${2?--extras needs a list} && shift ;;
    --editable) EDITABLE=1 ;;
    --no-editable) EDITABLE=0 ;;
    --torch-only) TORCH_ONLY=1 ;;
    --tag) TAG=${2:?--tag needs a name} && shift ;;
    --dry-run) DRY_RUN=1 ;;
    -h | --help) usage && exit 0 ;;
    *) usage >&2 && die "unknown argument: $1" ;;
  esac
  shift
done

case "$VARIANT" in
  cpu) BUILD="CPU build" DEFAULT_INDEX="" PYTORCH_INDEX=$PYTORCH_INDEX_CPU ;;
  cuda) BUILD="CUDA build" DEFAULT_INDEX=pytorch PYTORCH_INDEX=$PYTORCH_INDEX_CUDA ;;
  *) die "--variant must be cpu or cuda, not '$VARIANT'" ;;
esac
[ "$INDEX" = unset ] && INDEX=$DEFAULT_INDEX
[ "$INDEX" = pytorch ] && INDEX=$PYTORCH_INDEX
[[ $EXTRAS =~ ^[A-Za-z0-9_,-]*$ ]] || die "--extras must be a comma-separated list, not '$EXTRAS'"

# everything below runs from the repository root; a relative PYTHON stays the same file
if [[ $PY == */* && $PY != /* ]]; then
  PY="$PWD/$PY"
fi
cd "$(dirname "$0")/.."

PIP=("$PY" -m pip --disable-pip-version-check -q)
TORCH_CMD=("${PIP[@]}" install)
if [ -n "$INDEX" ]; then
  TORCH_CMD+=(--index-url "$INDEX")
  BUILD+=", from $INDEX"
fi
TORCH_CMD+=("torch==$TORCH_VERSION")
PROJECT=.${EXTRAS:+[$EXTRAS]}
PROJECT_CMD=("${PIP[@]}" install)
[ "$EDITABLE" = 1 ] && PROJECT_CMD+=(-e)
PROJECT_CMD+=("$PROJECT")

# torch==TORCH_VERSION already there (for cuda: a CUDA build of it)? Then it stays as it is.
have_torch() {
  "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION' \
or ('$VARIANT' == 'cuda' and torch.version.cuda is None))" 2>/dev/null
}

if [ "$DRY_RUN" = 1 ] || ! have_torch; then
  echo "[$TAG] installing torch==$TORCH_VERSION ($BUILD)"
  if [ "$DRY_RUN" = 1 ]; then show "${TORCH_CMD[@]}"; else "${TORCH_CMD[@]}"; fi
fi
[ "$TORCH_ONLY" = 1 ] && exit 0
echo "[$TAG] installing pipetransformer and its dependencies"
if [ "$DRY_RUN" = 1 ]; then show "${PROJECT_CMD[@]}"; else "${PROJECT_CMD[@]}"; fi
