#!/usr/bin/env bash
# On a lent GPU, in one call of the `device` tool after bench/gpu_kit.sh made .device/ here: bench/gpu.py on this
# tree's engine (after) and on the kit's BEFORE engine, one after the other on the same warm machine and with the
# same bench script, so the two are comparable (issue 69: decode against the HBM floor, the rules against the
# fixed-depth time line, before and after continuous depth batching).
#
#   device run: command "bash bench/gpu_before_after.sh", carry [".device"], timeout_s 600
#
# Figures go to $OUT/after.json and $OUT/before.json part by part (gpu.py adds each part as it finishes), the
# logs and the machine beside them. Each run is cut at EACH_S seconds (default 270: both, the wheels' install and
# the transfers within the call's 10 minutes, and a lease of 15 with the machine's start). GPU_BENCH_ARGS sizes
# the runs; the default is 37% of `--decode 32`'s loop steps (its docstring's 5 minutes on an H200, a guess
# until a GPU times it). tests/test_gpu_kit.py rehearses the call on a CPU; by hand, after
# `DEVICE_PYTHON=3.11 bench/gpu_kit.sh` (wheels for this machine's Python):
#   OUT=/tmp/gpu-out GPU_BENCH_ARGS="--device cpu --checkpoint $PWD/exitbench/checkpoints/tiny-raven --tokens 4
#   --max-steps 4 --repeats 1 --decode 2 --threads 1" EACH_S=120 bash bench/gpu_before_after.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
OUT="${OUT:?the device tool sets OUT, the folder whose files come back}"
EACH_S="${EACH_S:-270}"
read -r -a ARGS <<<"${GPU_BENCH_ARGS:---decode 16 --tokens 32 --repeats 2}"
if [ ! -f .device/before.tar ]; then
    echo "error: no .device/before.tar: run bench/gpu_kit.sh where the checkout is, and carry .device" >&2
    exit 2
fi

# the image's Python lacks pydantic (exitbench's typed readers import it): the kit's wheels, beside the image's
PIP_ROOT_USER_ACTION=ignore python3 -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    --no-cache-dir --upgrade --target /tmp/gpu-site .device/wheels/*.whl || exit 1
export PYTHONPATH=/tmp/gpu-site
before="$(mktemp -d)"
trap 'rm -rf "$before"' EXIT
tar -xf .device/before.tar -C "$before"
mkdir -p "$before/bench"
cp bench/gpu.py "$before/bench/"  # one bench for both engines: only exitbench/ differs

{
    echo "after $(cat .device/after.rev), before $(cat .device/before.rev), gpu.py ${ARGS[*]}, each cut at ${EACH_S} s"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    python3 -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)"
} | tee "$OUT/machine.txt"

status=0
for side in after before; do
    root=.
    [ "$side" = before ] && root="$before"
    echo "=== $side"
    start=$SECONDS
    (cd "$root" && timeout "$EACH_S" python3 bench/gpu.py "${ARGS[@]}" --json "$OUT/$side.json") 2>&1 |
        tee "$OUT/$side.log"
    code=${PIPESTATUS[0]}
    echo "=== $side: exit $code after $((SECONDS - start)) s" | tee -a "$OUT/$side.log"
    [ "$code" -eq 0 ] || status=$code
done
exit "$status"
