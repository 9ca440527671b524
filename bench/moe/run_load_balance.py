#!/usr/bin/python3
"""Issue 81's load-balance target: DeepSeek-V3's auxiliary-loss-free bias (--moe-bias-rate)
brings a mixture of experts' max / mean expert load under 1.2 within 200 steps on the python3-doc
corpus, against at least 2 with no balancing.

The same llama with experts (sigmoid scores as DeepSeek-V3's, no auxiliary loss) trains 200 steps
on 2 ranks from the same seed with each bias rate; every step's per-layer max / mean load (summed
over the step's micro-batches and both ranks, dtrain's metrics file) is kept as the curve (raw
records, and a PNG of the worst layer's). The figures per run: the worst layer's mean over the
last 20 steps, and the first step from which the worst layer's 10-step moving average stays
under 1.2.

  bench/moe/run_load_balance.py [--steps 200] [--rates 0,0.001,0.002,0.005,0.01] [--markdown F]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from report import ROOT, Records, default_build, table  # noqa: E402

# python3-doc's library reference in reST (the text dataset reads a folder's files, not below it)
CORPUS = "/usr/share/doc/python3.11/html/_sources/library"


def corpus_file(work):
    """The library reference's .rst.txt files in name order, as one UTF-8 file."""
    path = os.path.join(work, "library.txt")
    with open(path, "w", encoding="utf-8") as out:
        for name in sorted(os.listdir(CORPUS)):
            if name.endswith(".txt"):
                with open(os.path.join(CORPUS, name), encoding="utf-8") as f:
                    out.write(f.read())
    return path


def train(dtrain, rate, steps, threads, work, extra):
    metrics = os.path.join(work, f"rate-{rate}.jsonl")
    command = [dtrain, "train", "--model", "llama", "--dataset", "text", "--text-file",
               os.path.join(work, "library.txt"),
               "--layers", "4", "--width", "64", "--heads", "4", "--context", "64",
               "--moe-experts", "8", "--moe-top-k", "2", "--moe-score", "sigmoid",
               "--moe-first-dense", "1", "--moe-aux-loss", "0", "--moe-bias-rate", str(rate),
               "--batch-size", "16", "--max-steps", str(steps), "--eval-every", "0",
               "--nproc", "2", "--threads", str(threads), "--no-progress", "--no-run-dir",
               "--seed", "7", "--log-every", "1", "--metrics", metrics] + extra
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"run_load_balance: {' '.join(command)} failed:\n{done.stdout}{done.stderr}")
    curve = []
    with open(metrics) as f:
        for line in f:
            record = json.loads(line)
            if record.get("event") == "step":
                curve.append({key: value for key, value in record.items()
                              if key == "step" or key.startswith("moe_imbalance")})
    return command, curve


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--build", default=default_build())
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--rates", default="0,0.001,0.002,0.005,0.01")
    parser.add_argument("--plot", default=os.path.join(ROOT, "bench/results/moe/balance.png"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--records", default=os.path.join(ROOT, "bench/results/moe/balance.jsonl"))
    parser.add_argument("--markdown")
    args = parser.parse_args()
    dtrain = os.path.join(args.build, "dtrain")
    lines = ["| --moe-bias-rate | max / mean load, last 20 steps (worst layer) | "
             "at step 1 | 10-step average under 1.2 from step |",
             "|---|---|---|---|"]
    curves = {}
    with tempfile.TemporaryDirectory() as work, Records(args.records, "a", dtrain) as records:
        corpus_file(work)
        for rate in [float(r) for r in args.rates.split(",")]:
            command, curve = train(dtrain, rate, args.steps, args.threads, work, [])
            layers = sorted(k for k in curve[0] if k.startswith("moe_imbalance."))
            worst = [max(step[k] for k in layers) for step in curve]
            tail = curve[-20:]
            worst_tail = max(sum(step[k] for step in tail) / len(tail) for k in layers)
            average = [sum(worst[max(0, i - 9):i + 1]) / len(worst[max(0, i - 9):i + 1])
                       for i in range(len(worst))]
            under_from = None
            for index in range(len(average)):
                if all(a < 1.2 for a in average[index:]):
                    under_from = curve[index]["step"]
                    break
            curves[rate] = ([step["step"] for step in curve], worst)
            records.write({"bench": "moe_load_balance", "command": " ".join(command),
                           "rate": rate, "steps": args.steps, "layers": layers,
                           "worst_last20": worst_tail, "average10_under_1_2_from": under_from,
                           "curve": curve})
            lines.append(f"| {rate:g} | {worst_tail:.2f} | {worst[0]:.2f} | "
                         f"{under_from if under_from is not None else 'not within the run'} |")
            print(lines[-1], flush=True)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axis = plt.subplots(figsize=(8, 4.5))
        for rate, (steps, worst) in curves.items():
            axis.plot(steps, worst, linewidth=1, label=f"--moe-bias-rate {rate:g}")
        axis.axhline(1.2, color="tab:gray", linestyle=":", linewidth=1)
        axis.set_xlabel("step")
        axis.set_ylabel("max / mean expert load (worst layer)")
        axis.set_title("llama with 8 experts (top-2, sigmoid) on python3-doc, 2 ranks")
        axis.legend(fontsize=8)
        axis.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)
        print(f"plot: {args.plot}")
    except ImportError:
        print("(matplotlib not installed: no plot)")
    table(lines, args.markdown)


if __name__ == "__main__":
    main()
