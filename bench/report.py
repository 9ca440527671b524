"""How every benchmark script reports: its table printed and, with --markdown FILE, written to
FILE for BENCHMARKS.md."""


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
    date (UTC), the machine (its CPU, cores and memory) and, given the dtrain binary that ran,
    "dtrain_version" (`dtrain --version`: dtrain, LibTorch, CUDA, services; "" for a dtrain
    older than --version)."""
    import os
    import subprocess
    import time
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
        record["dtrain_version"] = run(dtrain, "--version").replace("\n", "; ")
    return record
