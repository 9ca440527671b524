"""How every benchmark script reports: its table printed and, with --markdown FILE, written to
FILE for BENCHMARKS.md; its raw records written through Records (JSON Lines) or open_log (a
text log), each stamped with the commit, the date, the machine and the dtrain and LibTorch
versions (stamp)."""
import json
import os
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def default_build():
    """The build directory a benchmark runs by default: build/ (the README's), else build-unity/
    (scripts/build -DDTRAIN_UNITY_BUILD=ON's usual folder), whichever holds a dtrain."""
    build = os.path.join(ROOT, "build")
    if os.access(os.path.join(build, "dtrain"), os.X_OK):
        return build
    return os.path.join(ROOT, "build-unity")


def alternated_rounds(sides, rounds, run_one, records, describe):
    """Runs every side once per round, in reverse order every other round (A B C, C B A, ...):
    `run_one(side)` returns a result dict, stamped here with its round, written to `records`
    (Records) and printed as "round N SIDE: describe(result)". Returns one {side: result} per
    round."""
    out = []
    width = max(len(side) for side in sides)
    for index in range(rounds):
        order = sides if index % 2 == 0 else tuple(reversed(sides))
        results = {}
        for side in order:
            result = run_one(side)
            result["round"] = index + 1
            records.write(result)
            results[side] = result
            print(f"round {index + 1} {side:{width}s}: {describe(result)}", flush=True)
        out.append(results)
    return out


def emit(text, markdown):
    """Prints `text` and writes it (ending in one newline) to `markdown` when given."""
    print(text)
    if markdown:
        with open(markdown, "w") as f:
            f.write(text if text.endswith("\n") else text + "\n")


def table(lines, markdown):
    """Prints the table's lines and writes them to `markdown` when given."""
    emit("\n".join(lines), markdown)


def stamp(dtrain=None):
    """What every raw record carries: the commit (with "-dirty" when the tree has changes), the
    date (UTC), the machine (its CPU, cores and memory), "dtrain_version" (`dtrain --version` of
    the binary that ran, by default build/dtrain: dtrain, LibTorch, CUDA, services; "" for a
    dtrain older than --version) and "libtorch" (its LibTorch version)."""
    import time
    root = ROOT
    if dtrain is None:
        default = os.path.join(root, "build", "dtrain")
        dtrain = default if os.access(default, os.X_OK) else None

    def run(*command):
        done = subprocess.run(command, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = run("git", "-C", root, "rev-parse", "--short", "HEAD")
    if run("git", "-C", root, "status", "--porcelain", "--untracked-files=no"):
        commit += "-dirty"
    cpu = "unknown CPU"
    flags = set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and cpu == "unknown CPU":
                    cpu = value.strip()
                elif key.strip() in ("flags", "Features") and not flags:
                    flags = set(value.split())
    except OSError:
        pass
    vector = [name for name in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if name in flags]
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    record = {"commit": commit,
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "machine": f"{cpu} ({' '.join(vector) or 'no AVX2'}), {os.cpu_count()} cores, "
                         f"{memory_gib:.0f} GiB"}
    if dtrain:
        version = run(dtrain, "--version")
        record["dtrain_version"] = version.replace("\n", "; ")
        for line in version.split("\n"):
            if line.startswith("LibTorch "):
                record["libtorch"] = line.split()[1]
    return record


class Records:
    """A file of raw records (JSON Lines): write(record) appends one, stamped (stamp() is taken
    once, when the file is opened; a record's own fields win). A with-statement closes it."""

    def __init__(self, path, mode="a", dtrain=None):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self.file = open(path, mode)
        self.stamp = stamp(dtrain)

    def write(self, record):
        self.file.write(json.dumps({**self.stamp, **record}) + "\n")
        self.file.flush()

    def flush(self):
        self.file.flush()

    def close(self):
        self.file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_log(path, mode="w", dtrain=None):
    """A text log whose first line is "# " and its stamp (JSON)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    log = open(path, mode)
    log.write("# " + json.dumps(stamp(dtrain)) + "\n")
    log.flush()
    return log


def dtrain_steps(command, metrics, steps):
    """Runs a `dtrain train` command that writes `metrics` (--metrics, --log-every 1) until it has
    logged `steps` step records, then stops it: the evaluation that follows training is not timed.
    Returns the step records (SystemExit with the run's output if it ends first). The run is a
    process group of its own, stopped whole: with --nproc the ranks are the launcher's children,
    and would go on writing `metrics` into the next round."""
    import signal
    import time
    if os.path.exists(metrics):
        os.remove(metrics)
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    seen = []
    try:
        while len(seen) < steps:
            time.sleep(0.5)
            if os.path.exists(metrics):
                seen = [json.loads(line) for line in open(metrics) if line.endswith("\n")]
                seen = [r for r in seen if r.get("event") == "step"]
            if process.poll() is not None and len(seen) < steps:
                raise SystemExit(f"dtrain failed:\n{process.stdout.read()[-3000:]}")
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
    return seen[:steps]


_runs = None


def record_runs(path, dtrain=None):
    """From now on record_run() appends each run to `path` (Records: stamped)."""
    global _runs
    _runs = Records(path, "a", dtrain)


def record_run(command, result):
    """One benchmark run's command and the JSON it printed, to record_runs()'s file (if any)."""
    if _runs is not None:
        _runs.write({"command": " ".join(command), **result})
