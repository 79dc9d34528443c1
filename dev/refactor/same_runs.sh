#!/usr/bin/env bash
# same_runs.sh BEFORE AFTER [cpu|cuda]: whether a change left training unchanged to the bit.
# Trains every linear-mixer variant (the six mixers, CARVE, CCQ learned and fixed, each
# routing, grouped value heads, no conv) and the Mamba-2, Mamba-3 and GLA-Hedgehog layers for
# six steps with the `lar` binary BEFORE and the `lar` binary AFTER, and compares each run's
# losses, gradient norms, evaluations and the final parameters' and optimizer state's sha256
# (the checkpoint header's). On cuda the runs are deterministic: true. Prints one line per
# variant that differs and exits 1 if any does.
#   dev/refactor/same_runs.sh /tmp/lar-before build/lar cpu
set -u
BEFORE=${1:?usage: same_runs.sh BEFORE AFTER [cpu|cuda]}
AFTER=${2:?usage: same_runs.sh BEFORE AFTER [cpu|cuda]}
BACKEND=${3:-cpu}
case $BACKEND in cpu) DET=false ;; cuda) DET=true ;; *) echo "same_runs.sh: backend '$BACKEND' (cpu or cuda)" >&2; exit 2 ;; esac
for b in "$BEFORE" "$AFTER"; do [ -x "$b" ] || { echo "same_runs.sh: $b is not an executable" >&2; exit 2; }; done
variants=(
  "linear|architecture: linear"
  "gla|architecture: gla"
  "deltanet|architecture: deltanet"
  "gdn|architecture: gdn"
  "kda|architecture: kda"
  "gdn2|architecture: gdn2"
  "carve|architecture: carve"
  "carve_frozen|architecture: carve, carve: {freeze_content: true}"
  "gdn_ccq|architecture: gdn, ccq: {enabled: true}"
  "gla_ccq_fixed|architecture: gla, ccq: {enabled: true, lambda: 0.05, centered: false}"
  "gdn_cler|architecture: gdn, routing: cler, n_layers: 3"
  "kda_cler_h_update|architecture: kda, routing: cler_h, routing_signal: update, n_layers: 3"
  "gdn2_clvr|architecture: gdn2, routing: clvr, n_layers: 3"
  "deltanet_cler|architecture: deltanet, routing: cler, n_layers: 3"
  "gdn_grouped|architecture: gdn, n_v_heads: 4, n_heads: 2"
  "kda_grouped|architecture: kda, n_v_heads: 4, n_heads: 2"
  "gla_l2|architecture: gla, qk_l2norm: true"
  "gdn_noconv|architecture: gdn, short_conv: false"
  "mamba2|architecture: mamba2"
  "mamba3|architecture: mamba3"
  "gla_hedgehog|architecture: gla_hedgehog"
)
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
# run LAR NAME MODEL: the run's metrics and checkpoint digest on stdout
run() {
  local d="$work/$2-$RANDOM"
  mkdir -p "$d"
  cat > "$d/run.yaml" <<YAML
seed: 5
threads: 1
backend: $BACKEND
deterministic: $DET
model: {stack: pure, n_layers: 2, d_model: 128, n_heads: 2, head_dim: 64, value_dim: 64, vocab_size: 64, $3}
data: {task: mqar, seq_len: 128, batch_size: 4, num_kv_pairs: 4}
optimizer: {lr: 3.0e-3}
budget: {steps: 6}
eval: {every: 3, batches: 1}
checkpoint: {every: 0, keep: 1}
YAML
  "$1" train --run-dir "$d/run" --config "$d/run.yaml" --no-progress > "$d/log" 2>&1
  echo "rc=$?"
  python3 - "$d/run" <<'PY'
import glob, json, struct, sys
run = sys.argv[1]
try:
    for line in open(run + "/metrics.jsonl"):
        o = json.loads(line)
        print({k: o[k] for k in ("step", "loss", "grad_norm", "val_loss", "acc") if k in o})
except OSError as e:
    print("no metrics:", e)
for f in sorted(glob.glob(run + "/checkpoints/*.ckpt")):
    b = open(f, "rb").read()
    n = struct.unpack("<Q", b[8:16])[0]
    print("params+optimizer sha256", json.loads(b[16:16 + n])["sha256"])
PY
}
differ=0
for v in "${variants[@]}"; do
  name=${v%%|*}; model=${v#*|}
  if [ "$(run "$BEFORE" "$name" "$model")" == "$(run "$AFTER" "$name" "$model")" ]; then
    echo "same    $name"
  else
    echo "DIFFERS $name"; differ=1
  fi
done
exit $differ
