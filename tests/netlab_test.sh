#!/usr/bin/env bash
# The network lab (scripts/netlab): its hosts reach each other through the shaped links, the
# lab is torn down when the command fails and when the lab itself is terminated, and bad
# profiles or overrides are one line, exit 2, with nothing left behind. Root only (exit 77:
# skipped).
set -uo pipefail
netlab=${1:?usage: netlab_test.sh SCRIPTS_DIR}/netlab
if [[ $(id -u) != 0 ]]; then echo "netlab needs root: skipped"; exit 77; fi
fail() { echo "FAIL: $*"; exit 1; }
# Lab names of this run (two builds' tests may run at once).
id=$(($$ % 100000))
left() { ip netns list | grep -c "^dtl-t${id}x$1-" || true; }

# The hosts see their addresses and reach host 0 over TCP (through the delay line).
reach='
import os, socket, sys, time
host, hosts = int(os.environ["NETLAB_HOST"]), int(os.environ["NETLAB_HOSTS"])
assert os.environ["NETLAB_ADDR"] == "10.77.%d.2" % host == sys.argv[1], sys.argv[1]
if host == 0:
    s = socket.create_server((os.environ["NETLAB_ADDR0"], 5300))
    for _ in range(hosts - 1):
        c, _ = s.accept(); c.sendall(c.recv(16))
else:
    for attempt in range(50):
        try:
            c = socket.create_connection((os.environ["NETLAB_ADDR0"], 5300)); break
        except OSError:
            time.sleep(0.1)
    c.sendall(b"hello"); assert c.recv(16) == b"hello"
'
"$netlab" run --name t${id}x1 --hosts 3 --profile 100mbit/4ms -- /usr/bin/python3 -c "$reach" '{addr}' ||
  fail "hosts could not reach host 0"
[[ $(left 1) == 0 ]] || fail "lab t1 left namespaces behind"

# A failing command: its exit status, and no namespace left.
"$netlab" run --name t${id}x2 --hosts 2 --profile wan -- sh -c 'exit 3'
code=$?
[[ $code == 3 ]] || fail "a failing command gave exit status $code, not 3"
[[ $(left 2) == 0 ]] || fail "lab t2 left namespaces behind after a failing command"

# The lab terminated while its command runs: still torn down.
"$netlab" run --name t${id}x3 --hosts 2 --profile wan -- sleep 60 &
lab=$!
for _ in $(seq 50); do [[ $(left 3) == 3 ]] && break; sleep 0.1; done
[[ $(left 3) == 3 ]] || fail "lab t3 did not come up"
sleep 0.5
kill -TERM $lab
wait $lab
[[ $(left 3) == 0 ]] || fail "lab t3 left namespaces behind after SIGTERM"

# Bad input: one line naming it, exit 2, nothing made.
check_bad() {
  local expected=$1; shift
  local out code
  out=$("$netlab" "$@" 2>&1); code=$?
  [[ $code == 2 ]] || fail "'$*' exited $code, not 2"
  [[ $(printf '%s\n' "$out" | wc -l) == 1 ]] || fail "'$*' printed more than one line: $out"
  [[ $out == *"$expected"* ]] || fail "'$*' said '$out', not '$expected'"
  [[ $(left 4) == 0 ]] || fail "'$*' left namespaces behind"
}
check_bad "profile 'wam' is neither" run --name t${id}x4 --profile wam -- true
check_bad "rate 'fast' is not a number" run --name t${id}x4 --profile fast/20ms -- true
check_bad "delay '20' is not a number" run --name t${id}x4 --profile 100mbit/20 -- true
check_bad "there is no host 5 among 2" run --name t${id}x4 --override 5=wan -- true
check_bad "is not HOST=PROFILE" run --name t${id}x4 --override slow -- true
check_bad "run needs a command after --" run --name t${id}x4
# Not root: one line, exit 2 (run as nobody).
if command -v setpriv >/dev/null; then
  out=$(setpriv --reuid=65534 --regid=65534 --clear-groups env PATH=/usr/sbin:/usr/bin:/bin \
        /usr/bin/python3 "$netlab" run --name t${id}x4 -- true 2>&1); code=$?
  [[ $code == 2 && $out == "netlab: the network lab needs root (network namespaces and tc)" ]] ||
    fail "as nobody: exit $code, '$out'"
fi
echo "netlab: all checks passed"
