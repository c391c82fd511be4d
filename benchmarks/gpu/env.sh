# Sourced by the GPU scripts in gpu-run/ (staged by benchmarks/gpu/stage.sh), run from the
# repository root: sets where results go ($OUT), the staged binary ($BIN), a library path that
# loads torch's own CUDA and NCCL libraries, and PYTHONPATH for the test helpers in tests/python.
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
SITE=$(python3 -c 'import torch,os;print(os.path.dirname(os.path.dirname(torch.__file__)))')
CUDART=$(dirname "$(find "$SITE/nvidia" -name 'libcudart.so.13*' | head -1)")
# torch's own NVIDIA folders first: the system NCCL must not be the one loaded.
export LD_LIBRARY_PATH=$SITE/torch/lib:$SITE/nvidia/nccl/lib:$CUDART${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
BIN=$HERE/hslake
export PYTHONPATH=$PWD/tests/python${PYTHONPATH:+:$PYTHONPATH}
