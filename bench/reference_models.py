"""The PyTorch twins of dtrain's reference models (src/models/Zoo.cpp), shared by the reference
benchmarks."""
import resource

import torch.nn as nn
import torch.nn.functional as F


def status_mb(key):
    """A /proc/self/status field in MB ("VmRSS:", "VmHWM:"), 0 when absent."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key):
                return float(line.split()[1]) / 1024.0
    return 0.0


def rss_mb():
    return status_mb("VmRSS:")


_peak_before_reset = 0.0


def peak_rss_mb():
    """Peak resident set of the whole process life, MB (across reset_peak() calls)."""
    return max(_peak_before_reset, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0)


def reset_peak():
    """Resets the kernel's peak-RSS counter (VmHWM, which ru_maxrss follows) to the current RSS,
    so status_mb("VmHWM:") measures from now on; False where not allowed."""
    global _peak_before_reset
    _peak_before_reset = peak_rss_mb()
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


class Mlp(nn.Module):
    """784 -> hidden... -> 10 with ReLU, as dtrain's `mlp`."""

    def __init__(self, hidden=(256, 256)):
        super().__init__()
        layers, width = [], 784
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()]
            width = h
        layers.append(nn.Linear(width, 10))
        self.layers = nn.Sequential(*layers)

    def forward(self, x):
        return self.layers(x.flatten(1))


class Cnn(nn.Module):
    """Two 3x3 conv blocks and a two-layer head, as dtrain's `cnn`."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.conv1(x)), 2)
        h = F.max_pool2d(F.relu(self.conv2(h)), 2)
        return self.fc2(F.relu(self.fc1(h.flatten(1))))


def timed_steps(step, warmup, steps):
    """Runs `step()` warmup + steps times, each after a barrier, as dtrain's benchmarks time
    theirs; returns (median over the measured steps of the slowest rank's ms, the largest
    rank's RSS peak over the measured steps in MB, -1 where it cannot be reset)."""
    import statistics
    import time

    import torch
    import torch.distributed as dist
    times = []
    peak_reset = False
    for i in range(warmup + steps):
        if i == warmup:
            peak_reset = reset_peak()
        dist.barrier()
        start = time.perf_counter()
        step()
        ms = torch.tensor([(time.perf_counter() - start) * 1e3], dtype=torch.float64)
        dist.all_reduce(ms, op=dist.ReduceOp.MAX)
        if i >= warmup:
            times.append(ms.item())
    rss = torch.tensor([status_mb("VmHWM:") if peak_reset else -1.0], dtype=torch.float64)
    dist.all_reduce(rss, op=dist.ReduceOp.MAX)
    return statistics.median(times), rss.item()


def leave():
    """Ends a peer rank once every rank has arrived. PyTorch 2.x's gloo now and then aborts a
    rank while tearing the group down ("terminate called without an active exception", after
    the results), so the rank leaves without the teardown; the timed work is done."""
    import os
    import sys

    import torch.distributed as dist
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)
