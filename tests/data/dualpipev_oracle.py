"""PyTorch's DualPipe-V order (torch.distributed.pipelining.ScheduleDualPipeV, PyTorch 2.x in
.venv-torch), printed in dtrain's notation for pipeline_test: one line per rank, actions
separated by spaces, each P:M given a block of P lines. Usage: dualpipev_oracle.py P:M ...

PyTorch's list names the virtual stage of each action; dtrain names the rank's chunk (0 for
stage r, 1 for stage 2P - 1 - r). A full backward is dtrain's B followed by its W; an
overlapped pair (OVERLAP_F_B) is its forward marked '&', then its full backward."""
import sys
import types

from torch.distributed.pipelining import schedules as S


def listing(p, m, rank):
    # The order is computed from these three fields alone (no process group is needed).
    me = types.SimpleNamespace(pp_group_size=p, _n_microbatches=m)
    actions = S.ScheduleDualPipeV._calculate_single_rank_operations(me, rank)
    chunk_of = {rank: 0, 2 * p - 1 - rank: 1}
    out = []

    def name(letter, stage, mb, mark=""):
        chunk = chunk_of[stage]
        return f"{letter}{mb}{'.1' if chunk else ''}{mark}"

    for a in actions:
        kind = a.computation_type
        if kind == S.OVERLAP_F_B:
            f, b = a.sub_actions
            out.append(name("F", f.stage_index, f.microbatch_index, "&"))
            out.append(name("B", b.stage_index, b.microbatch_index))
            out.append(name("W", b.stage_index, b.microbatch_index))
        elif kind == S.FORWARD:
            out.append(name("F", a.stage_index, a.microbatch_index))
        elif kind == S.FULL_BACKWARD:
            out.append(name("B", a.stage_index, a.microbatch_index))
            out.append(name("W", a.stage_index, a.microbatch_index))
        elif kind == S.BACKWARD_INPUT:
            out.append(name("B", a.stage_index, a.microbatch_index))
        elif kind == S.BACKWARD_WEIGHT:
            out.append(name("W", a.stage_index, a.microbatch_index))
        else:
            raise SystemExit(f"unexpected action {a}")
    return " ".join(out)


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        p, m = map(int, spec.split(":"))
        for rank in range(p):
            print(listing(p, m, rank))
