#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image (Ubuntu 22.04 or
# 24.04, with internet). It installs Python and what the grader imports under /opt/autograde,
# readable by every user: the grader runs each submission as an unprivileged user.
set -euo pipefail

PREFIX=/opt/autograde
SOURCE="${AUTOGRADER_ROOT:-/autograder}/source"
# The Python the course's tests run on. uv installs the same standalone build on either image
# (22.04 ships 3.10, 24.04 ships 3.12), with no PPA and no system pip involved.
PYTHON_VERSION=3.11
UV_VERSION=0.13.9

export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends ca-certificates curl

export UV_UNMANAGED_INSTALL="$PREFIX/bin" UV_PYTHON_INSTALL_DIR="$PREFIX/python"
curl -LsSf "https://astral.sh/uv/$UV_VERSION/install.sh" | sh
UV="$PREFIX/bin/uv"
"$UV" python install "$PYTHON_VERSION"
"$UV" venv --python "$PYTHON_VERSION" --managed-python "$PREFIX/venv"
PYTHON="$PREFIX/venv/bin/python"

# The CPU build of torch from PyTorch's index (PyPI's Linux wheels pull in CUDA), then the rest.
"$UV" pip install --python "$PYTHON" --index-url https://download.pytorch.org/whl/cpu "torch>=2.5,<3"
"$UV" pip install --python "$PYTHON" -r "$SOURCE/requirements.txt"
"$UV" cache clean
chmod -R a+rX "$PREFIX"

# Fail here rather than at the first submission: the grader and its exercises import.
cd "$SOURCE"
TRITON_INTERPRET=1 "$PYTHON" -c "import autograde.frontends.gradescope, torch, triton; assert torch.version.cuda is None"
echo "installed $("$PYTHON" --version), torch $("$PYTHON" -c 'import torch; print(torch.__version__)')"
