#!/bin/sh
# benchmarks/fuzz_aggregate.py in N processes at once (seeds 1..N, INPUTS/N inputs each), then one
# summary: what a >= 100,000-input run takes on a many-core machine in minutes instead of hours.
#   sh benchmarks/fuzz_shards.sh 40 100000 OUTDIR
set -e
n=$1; total=$2; out=$3
mkdir -p "$out"
each=$((total / n))
start=$(date +%s)
for s in $(seq 1 "$n"); do
    nice -n 10 python3 benchmarks/fuzz_aggregate.py --inputs "$each" --seed "$s" --progress 0 \
        --json "$out/seed$s.json" > "$out/seed$s.log" 2>&1 &
done
wait
echo "wall $(( $(date +%s) - start )) s for $n x $each inputs"
python3 - "$out" "$n" <<'PY'
import json, sys
out, n = sys.argv[1], int(sys.argv[2])
runs = [json.load(open(f"{out}/seed{s}.json")) for s in range(1, n + 1)]
slow = [dict(x, seed=r["seed"]) for r in runs for x in r["slow"]]
internal = [dict(x, seed=r["seed"]) for r in runs for x in r["internal"]]
worst = max(runs, key=lambda r: r["worst_cpu_s"])
summary = {"inputs": sum(r["inputs"] for r in runs), "shards": n,
           "internal_errors": sum(r["internal_errors"] for r in runs),
           "reader_exceptions_caught": sum(r["reader_exceptions_caught"] for r in runs),
           "inputs_over_2s_cpu": sum(r["inputs_over_slow"] for r in runs),
           "inputs_over_2s_wall": sum(r["inputs_over_slow_wall"] for r in runs),
           "worst_cpu_s": worst["worst_cpu_s"], "worst_cpu_kind": worst["worst_cpu_kind"], "worst_cpu_seed": worst["seed"],
           "worst_wall_s": max(r["worst_wall_s"] for r in runs),
           "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
           "tracemalloc_peak_mb": max(r["tracemalloc_peak_mb"] for r in runs),
           "mean_cpu_ms": round(sum(r["mean_cpu_ms"] * r["inputs"] for r in runs) / sum(r["inputs"] for r in runs), 2),
           "slow": slow[:50], "internal": internal[:50]}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
print(json.dumps({k: v for k, v in summary.items() if k not in ("slow", "internal")}), slow[:10], internal[:5])
PY
