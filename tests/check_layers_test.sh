#!/usr/bin/env bash
# scripts/check-layers passes on the tree, and fails naming the file, line and layers when a
# copy of the tree gets an include that runs up (common -> train) or sideways (data -> optim), or
# code above the strategies that compares a strategy's name (the Trainer asking "zero3"? the
# planner asking "downpour"?) or a pipeline schedule's (the planner asking "interleaved"?), or above
# data/ a data set's (the federated CLI asking "fashion-mnist"?), a namespace that does not follow
# its folder (ZeRO's code back in dtrain::parallel) and a header name in two layers.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$root/scripts/check-layers" --root "$root"
cp -r "$root/src" "$root/include" "$root/cli" "$root/proto" "$work/"
echo '#include "dtrain/train/Trainer.h"' >> "$work/src/common/Error.cpp"
echo '#include "dtrain/optim/LrSchedule.h"' >> "$work/src/data/Dataset.cpp"
echo 'bool sharded(const std::string& s) { return s == "zero3"; }' >> "$work/src/train/Job.cpp"
echo 'bool images(const std::string& s) { return "fashion-mnist" != s; }' >> "$work/cli/FederatedShared.cpp"
echo 'bool served(const std::string& s) { return s == "downpour"; }' >> "$work/src/plan/Search.cpp"
echo 'bool chunked(const std::string& s) { return "interleaved" == s; }' >> "$work/src/plan/Layout.cpp"
printf 'namespace dtrain::parallel {\nint stray = 0;\n}  // namespace dtrain::parallel\n' >> "$work/src/parallel/zero/FlatShards.cpp"
printf 'namespace dtrain::comm {\nclass Forward;\n}\n' >> "$work/src/parallel/zero/ZeroStrategy.cpp"
printf "#pragma once\n" > "$work/include/dtrain/data/Error.h"
if out=$("$root/scripts/check-layers" --root "$work" 2>&1); then
  echo "FAIL: an upward include passed the layer check"; exit 1
fi
line=$(wc -l < "$work/src/common/Error.cpp")
job_line=$(wc -l < "$work/src/train/Job.cpp")
fl_line=$(wc -l < "$work/cli/FederatedShared.cpp")
search_line=$(wc -l < "$work/src/plan/Search.cpp")
layout_line=$(wc -l < "$work/src/plan/Layout.cpp")
ns_line=$(( $(wc -l < "$work/src/parallel/zero/FlatShards.cpp") - 2 ))
for expected in \
    "src/common/Error.cpp:$line: common (level 0) includes dtrain/train/Trainer.h, a layer above: train (level 5)" \
    "src/data/Dataset.cpp:" "includes dtrain/optim/LrSchedule.h, a sibling on its level: optim (level 2)" \
    "src/train/Job.cpp:$job_line: compares with the strategy name 'zero3'" \
    "cli/FederatedShared.cpp:$fl_line: compares with the data set name 'fashion-mnist'" \
    "src/plan/Search.cpp:$search_line: compares with the strategy name 'downpour'" \
    "src/plan/Layout.cpp:$layout_line: compares with the pipeline schedule name 'interleaved'" \
    "src/parallel/zero/FlatShards.cpp:$ns_line: namespace dtrain::parallel in a file of src/parallel/zero: expected dtrain::parallel::zero" \
    "Error.h: a header of this name in 2 layers (include/dtrain/common/Error.h, include/dtrain/data/Error.h)" \
    "8 include(s), name comparison(s), namespace(s) or header name(s) against the layers"; do
  if [[ $out != *"$expected"* ]]; then
    echo "FAIL: the layer check did not say: $expected"; echo "$out"; exit 1
  fi
done
echo "$out"
echo "check-layers: passes the tree, refuses an upward and a sideways include, a strategy name compared in train/ and plan/, a schedule's in plan/ and a data set's in cli/, a namespace off its folder and a header name in two layers (a forward declaration of another namespace's class passes)"
