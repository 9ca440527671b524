#!/usr/bin/env bash
# A cold build of the dtrain CLI with unity batches of N files, in a fresh build folder with an
# empty compiler cache; appends a stamped record to bench/results/builds/cold-build.jsonl.
#   bench/builds/cold_build.sh N [N ...]     (e.g. 32 8 16: run them in turns)
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
for batch in "$@"; do
  dir=/tmp/dtrain-cold-$batch cache=/tmp/dtrain-cold-ccache-$batch
  rm -rf "$dir" "$cache" && mkdir -p "$cache"
  start=$(date +%s)
  CCACHE_DIR=$cache cmake -S "$root" -B "$dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DDTRAIN_UNITY_BUILD=ON -DDTRAIN_UNITY_BATCH="$batch" > "$dir.configure.log" 2>&1
  mid=$(date +%s)
  CCACHE_DIR=$cache ninja -C "$dir" dtrain_cli > "$dir.log" 2>&1
  end=$(date +%s)
  units=$(grep -c 'Building CXX' "$dir.log" || true)
  echo "batch $batch: configure $((mid - start)) s, ninja $((end - mid)) s, $units units"
  python3 - "$root" "$batch" "$((mid - start))" "$((end - mid))" "$units" "$dir/dtrain" <<'PY'
import sys
sys.path.insert(0, sys.argv[1] + "/bench")
from report import Records
root, batch, configure, ninja, units, dtrain = sys.argv[1:]
with Records(root + "/bench/results/builds/cold-build.jsonl", "a", dtrain) as records:
    records.write({"target": "dtrain_cli", "unity_batch": int(batch), "configure_s": int(configure),
                   "ninja_s": int(ninja), "units": int(units)})
PY
done
