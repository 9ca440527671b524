# Two hosts on one machine, for the tests that source this file: two network namespaces joined by
# a veth pair. The sourcing test defines skip() (exit 77) first.
#
#   two_hosts NS_A NS_B VETH SUBNET   makes NS_A (SUBNET.1 on ${VETH}a) and NS_B (SUBNET.2 on
#                                     ${VETH}b), loopback up in both; skips where it cannot
#   remove_two_hosts NS_A NS_B        kills what still runs in them and removes them

two_hosts() {
  local a=$1 b=$2 veth=$3 subnet=$4 ns
  ip netns add "$a" 2>/dev/null || skip "cannot create network namespaces here"
  ip netns add "$b" || skip "cannot create a second network namespace"
  ip link add "${veth}a" type veth peer name "${veth}b" || skip "cannot create a veth pair"
  ip link set "${veth}a" netns "$a"
  ip link set "${veth}b" netns "$b"
  ip -n "$a" addr add "$subnet.1/24" dev "${veth}a"
  ip -n "$b" addr add "$subnet.2/24" dev "${veth}b"
  for ns in "$a" "$b"; do ip -n "$ns" link set lo up; done
  ip -n "$a" link set "${veth}a" up
  ip -n "$b" link set "${veth}b" up
}

remove_two_hosts() {
  local ns
  for ns in "$@"; do ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null; done
  for ns in "$@"; do ip netns del "$ns" 2>/dev/null; done
}
