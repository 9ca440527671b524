#!/usr/bin/env bash
# scripts/setup --torch pip on bad input: no network, a wheel of another version, an unknown
# --torch; each is one line naming what is wrong, a non-zero exit, and nothing left in the way
# (an environment that was there before is put back as it was). Runs a copy of scripts/ in a
# scratch checkout, so the real .venv-torch is never touched.
set -uo pipefail
source_dir=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$source_dir/scripts" "$work/"
cd "$work"
fail() { echo "FAIL: $*"; exit 1; }

# A previous complete environment (of another pinned version) that must survive a failure.
mkdir -p .venv-torch/bin
printf '#!/bin/sh\necho 2.0.0\n' > .venv-torch/bin/python
chmod +x .venv-torch/bin/python
touch .venv-torch/.complete

out=$(PIP_INDEX_URL=http://127.0.0.1:9/simple PIP_RETRIES=0 PIP_DEFAULT_TIMEOUT=2 \
      PIP_NO_CACHE_DIR=1 PIP_FIND_LINKS= scripts/setup --torch pip 2>&1)
rc=$?
[[ $rc -ne 0 ]] || fail "no network: exit 0"
grep -q "setup: cannot download torch==" <<<"$out" || fail "no network: no clear line: $out"
[[ -f .venv-torch/.complete && $(.venv-torch/bin/python) == 2.0.0 ]] ||
  fail "no network: the previous environment was not put back"
[[ ! -e .venv-torch.old ]] || fail "no network: .venv-torch.old left behind"

wheel=$work/torch-1.0.0-cp311-cp311-manylinux_2_28_x86_64.whl
touch "$wheel"
out=$(scripts/setup --torch pip --wheel "$wheel" 2>&1)
[[ $? -ne 0 ]] || fail "wrong wheel: exit 0"
grep -q "is torch 1.0.0, scripts/torch-pip.txt pins torch==" <<<"$out" || fail "wrong wheel: $out"

out=$(scripts/setup --torch pip --wheel "$work/missing.whl" 2>&1)
[[ $? -ne 0 ]] || fail "missing wheel: exit 0"
grep -q "missing.whl: no such file" <<<"$out" || fail "missing wheel: $out"

out=$(scripts/setup --torch conda 2>&1)
[[ $? -eq 2 ]] || fail "unknown --torch: exit $?"
grep -q "must be debian or pip, got 'conda'" <<<"$out" || fail "unknown --torch: $out"
echo "setup refuses bad input with one line and leaves the environment as it was"
