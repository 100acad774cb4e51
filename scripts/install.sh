#!/usr/bin/env bash
# Install torch (pinned, first) and then this project into the environment of PYTHON, every
# package at the version requirements/lock.txt pins (scripts/lock.sh writes it).
# The one place that says which torch and from where: scripts/setup.sh (development, CI) and the
# Dockerfile's builder stages all run this script; `--dry-run` prints what it would run.
set -euo pipefail

# The torch every environment of this project gets. The pyproject range (torch>=2.6) is
# satisfied by it, so installing the project afterwards keeps it.
TORCH_VERSION=2.13.0
# PyTorch's own wheel indexes (`--torch-index pytorch`). torch 2.13 is built for CUDA 12.6 and
# 13.0 (13.2 experimental): cu126 runs on the oldest drivers, cu130 adds Blackwell+PTX (pass it
# with --torch-index URL). The CUDA wheels carry their own CUDA runtime (nvidia-* wheels).
PYTORCH_INDEX_CPU=https://download.pytorch.org/whl/cpu
PYTORCH_INDEX_CUDA=https://download.pytorch.org/whl/cu126
# Every other package's version (pip constraints: what an install reaches is pinned, nothing more
# is installed). Regenerate it with scripts/lock.sh after changing pyproject.toml.
LOCK_DEFAULT=requirements/lock.txt

usage() {
  cat <<EOF
usage: scripts/install.sh PYTHON [--variant cpu|cuda] [--torch-index URL|pytorch|pip]
                          [--extras LIST] [--editable|--no-editable] [--torch-only]
                          [--lock FILE|none] [--tag NAME] [--dry-run]

Installs torch==$TORCH_VERSION first, then this project, with PYTHON's pip, every package at
the version the lock pins; then checks that everything the project needs is pinned there.

  PYTHON          the interpreter whose environment gets everything (e.g. .venv/bin/python)
  --variant       cpu (default) or cuda: which torch build
  --torch-index   where torch comes from: a URL, or 'pytorch' for PyTorch's index of the variant
                  (cpu: $PYTORCH_INDEX_CPU, cuda: $PYTORCH_INDEX_CUDA),
                  or 'pip' for pip's own index and find-links (PIP_INDEX_URL, PIP_FIND_LINKS:
                  a mirror, a folder of wheels). torch comes from there without its
                  dependencies; they come, pinned, from pip's index.
                  Default: 'pip' for cpu (plain 'pip install torch==$TORCH_VERSION', which on this
                  project's machines takes the local CPU wheel), 'pytorch' for cuda
  --extras        comma-separated extras of the project, e.g. test,bench (default: none)
  --editable      pip install -e (default; development)   --no-editable   a regular install
  --torch-only    install torch (and its pinned dependencies) and stop (a cacheable image layer)
  --lock FILE     the pins (default: $LOCK_DEFAULT); 'none': no pins (trying newer releases)
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
LOCK=$LOCK_DEFAULT
while [ $# -gt 0 ]; do
  case "$1" in
    --variant) VARIANT=${2:?--variant needs cpu or cuda} && shift ;;
    --torch-index) INDEX=${2?--torch-index needs a URL or pytorch} && shift ;;
    --extras) EXTRAS=${2?--extras needs a list} && shift ;;
    --editable) EDITABLE=1 ;;
    --no-editable) EDITABLE=0 ;;
    --torch-only) TORCH_ONLY=1 ;;
    --lock) LOCK=${2:?--lock needs a file or none} && shift ;;
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
[ "$INDEX" = pip ] && INDEX=""
[[ $EXTRAS =~ ^[A-Za-z0-9_,-]*$ ]] || die "--extras must be a comma-separated list, not '$EXTRAS'"

# everything below runs from the repository root; a relative PYTHON or --lock stays the same file
if [[ $PY == */* && $PY != /* ]]; then
  PY="$PWD/$PY"
fi
if [[ $LOCK != "$LOCK_DEFAULT" && $LOCK != none && $LOCK != /* ]]; then
  LOCK="$PWD/$LOCK"
fi
cd "$(dirname "$0")/.."

# The Dockerfile's build arguments PIP_INDEX_URL, PIP_FIND_LINKS and PIP_NO_INDEX are always set,
# empty when not given: empty means pip's default, so unset, not an empty index or folder.
for var in PIP_INDEX_URL PIP_FIND_LINKS PIP_NO_INDEX; do
  [ -n "${!var:-}" ] || unset "$var"
done
PIP=("$PY" -m pip --disable-pip-version-check -q)
PINS=()
PINNED=""
if [ "$LOCK" != none ]; then
  [ -f "$LOCK" ] || die "no lock file $LOCK (scripts/lock.sh writes it)"
  PINS=(-c "$LOCK")
  PINNED=" (pinned by $LOCK)"
  # pip builds the project in an isolated environment of its own, which reads constraints from
  # the environment only: so the build backend (setuptools) is the lock's too
  if [[ $LOCK == /* ]]; then export PIP_CONSTRAINT=$LOCK; else export PIP_CONSTRAINT=$PWD/$LOCK; fi
fi
[ -n "$INDEX" ] && BUILD+=", from $INDEX"
PROJECT=.${EXTRAS:+[$EXTRAS]}

# one command: printed ('+ ...') on a dry run, else run
step() {
  if [ "$DRY_RUN" = 1 ]; then show "$@"; else "$@"; fi
}

# torch==TORCH_VERSION already there (for cuda: a CUDA build of it)? Then it stays as it is.
have_torch() {
  "$PY" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION' \
or ('$VARIANT' == 'cuda' and torch.version.cuda is None))" 2>/dev/null
}

if [ "$DRY_RUN" = 1 ] || ! have_torch; then
  echo "[$TAG] installing torch==$TORCH_VERSION ($BUILD)$PINNED"
  if [ -n "$INDEX" ]; then
    # the variant's build from its index, alone: that index need not carry the lock's versions
    # of torch's dependencies; the next command brings them from pip's own index
    step "${PIP[@]}" install --no-deps --index-url "$INDEX" "torch==$TORCH_VERSION"
  fi
  # torch's dependencies at the lock's versions (a CUDA build's nvidia-* and triton are pinned
  # exactly by the wheel itself); with no index above, torch itself too, from pip's index
  step "${PIP[@]}" install ${PINS[@]+"${PINS[@]}"} "torch==$TORCH_VERSION"
fi
[ "$TORCH_ONLY" = 1 ] && exit 0
echo "[$TAG] installing pipetransformer and its dependencies$PINNED"
if [ "$EDITABLE" = 1 ]; then
  step "${PIP[@]}" install ${PINS[@]+"${PINS[@]}"} -e "$PROJECT"
else
  step "${PIP[@]}" install ${PINS[@]+"${PINS[@]}"} "$PROJECT"
fi
if [ "$LOCK" != none ]; then
  # everything the installed project needs is pinned in the lock, at the version installed: a
  # dependency added to pyproject.toml without scripts/lock.sh fails here, not in production
  step "$PY" scripts/check_lock.py "$LOCK" "pipetransformer${EXTRAS:+[$EXTRAS]}"
fi
