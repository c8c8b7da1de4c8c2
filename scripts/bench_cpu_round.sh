#!/usr/bin/env bash
# The CPU figures of BENCHMARKS.md and the README's per-CPU table, again on this machine: one stream
# (94 tokens), offline 32 x 150 and 32 concurrent streams, per speed mode, in 3 alternating rounds (take
# medians), the reference in the same rounds. Run it on a quiet machine (nothing else running); every
# JSON line records the CPU. First the per-op kernel table (bench kernels: every library's trunk matmuls
# at 1/4/32 rows against the weight-read floor, 1 thread) and the audio stage per runtime (bench audio);
# decode attention per KV cache dtype (bench attention: bf16 and int8 against their read floors, at two
# context lengths); the load averages go in $O/uptime.log with each stage. Usage:
#   scripts/bench_cpu_round.sh CKPT REFERENCE_PYTHON OUT_DIR [ONNX_CACHE_DIR]
set -u
CK=${1:?checkpoint directory (chattts-serve checkpoint random CKPT --size full)}
REF=${2:?python of the reference environment (bash ../shared/oracle/setup_venv.sh DIR)}
O=${3:?output directory}
OC=${4:+--onnx-cache-dir $4}
mkdir -p "$O"
common="--model $CK --threads 2 $OC"
run() {
  local out=$1; shift
  echo "$out $(uptime)" >> "$O/uptime.log"
  chattts-serve "$@" >> "$O/$out.jsonl" 2>> "$O/err.log" || echo "failed: $*" >> "$O/err.log"
}
run kernels bench kernels --model "$CK" --threads 1 --rows 1,4,32 --rounds 5 --work-dir "$O"
run kernels_2t bench kernels --model "$CK" --threads 2 --rows 1,32 --rounds 3 --work-dir "$O" \
  --backends ort-int4-b32-a4,ort-int4-b128-a4,ort-int8,int4pack-g32-bf16,int4pack-g128-bf16,ov-int4-g128,ov-int8,onednn-bf16,cpp-int4-b128-bf16s,cpp-int4-b32-bf16s
run audio bench audio --model "$CK" --threads 1 --windows 1x150,8x150,1x48 --rounds 5
# The audio stage's floor (MACs per audio second, the core's peaks, the ov-bf16 graph per op) and its int8
# designs (speed and SNR on the trunk's own hidden states), then each audio dtype's cost in eval.
echo "audio_floor $(uptime)" >> "$O/uptime.log"
python scripts/audio_floor.py --model "$CK" --rounds 5 --runtimes ov-bf16,ov-fp32 >> "$O/audio_floor.jsonl" 2>> "$O/err.log"
echo "audio_designs $(uptime)" >> "$O/uptime.log"
python scripts/audio_designs.py --model "$CK" --rounds 5 --cache "$O/audio_hidden.pt" \
  --variants ov-bf16,ov-f32,int8-all,int8-linears,int8-smooth,dyn-g32,dyn-g128,dyn-g32-f32 \
  >> "$O/audio_designs.jsonl" 2>> "$O/err.log"
# The int4 mode (the hand-written GEMV) beside ort-int4-b128, its ONNX Runtime twin (same blocks).
run eval_int4 eval --model "$CK" --threads 1 --steps 100 --num-texts 4 --modes ort-int4-b128,int4
run eval_audio eval --model "$CK" --threads 1 --steps 150 --num-texts 4 --modes fp32 \
  --audio-dtypes bf16,ov-fp32,ov-bf16,ov-int8
run attention bench attention --threads 2 --rows 1,8,32 --min-len 300 --max-len 800 --json
run attention_long bench attention --threads 2 --rows 1,8,32 --min-len 1500 --max-len 2000 --no-fp32 --json
for round in 1 2 3; do
  run one_fp32_ref bench streams $common --precision fp32 --concurrency 1 --steps 94 --reference-python "$REF"
  for p in int8-static ort-int8 ort-int4 ort-int4-b128 ort-auto int4; do
    run "one_$p" bench streams $common --precision $p --audio-dtype bf16 --concurrency 1 --steps 94
  done
  # One core for the trunk, the other for the audio worker (the fastest one-stream split for int4, BENCHMARKS.md).
  run one_int4_1t bench streams --model "$CK" --threads 1 $OC --precision int4 --audio-dtype bf16 --audio-overlap on \
    --concurrency 1 --steps 94
  run one_int4_1t-ovbf16 bench streams --model "$CK" --threads 1 $OC --precision int4 --audio-dtype ov-bf16 \
    --audio-overlap on --concurrency 1 --steps 94
  run one_ort-int4-b128_1t bench streams --model "$CK" --threads 1 $OC --precision ort-int4-b128 --audio-dtype bf16 \
    --audio-overlap on --concurrency 1 --steps 94
  # The fastest modes now: int4 with the int8 audio graph, at 2 threads and split 1 + 1 with the audio worker.
  run one_int4-ovint8 bench streams $common --precision int4 --audio-dtype ov-int8 --concurrency 1 --steps 94
  run one_int4_1t-ovint8 bench streams --model "$CK" --threads 1 $OC --precision int4 --audio-dtype ov-int8 \
    --audio-overlap on --concurrency 1 --steps 94
  run one_ort-auto-ovbf16 bench streams $common --precision ort-auto --audio-dtype ov-bf16 --concurrency 1 --steps 94
  run one_ort-int4-b128-ovbf16 bench streams $common --precision ort-int4-b128 --audio-dtype ov-bf16 --concurrency 1 \
    --steps 94
  run one_ort-auto-ovint8 bench streams $common --precision ort-auto --audio-dtype ov-int8 --concurrency 1 --steps 94
  run one_int8-static-kvbf16 bench streams $common --precision int8-static --kv-cache-dtype bf16 --audio-dtype bf16 \
    --concurrency 1 --steps 94
  run one_int8-static-kvint8 bench streams $common --precision int8-static --kv-cache-dtype int8 --audio-dtype bf16 \
    --concurrency 1 --steps 94
  if [ "$round" = 1 ]; then
    run off_ref bench offline $common --precision int8-static --num-texts 32 --steps 150 --reference-python "$REF"
  fi
  for p in ort-int8 ort-auto int8-static int4; do
    run "off_$p" bench offline $common --precision $p --audio-dtype bf16 --num-texts 32 --steps 150
  done
  run off_int8-static-kvbf16 bench offline $common --precision int8-static --kv-cache-dtype bf16 --audio-dtype bf16 \
    --num-texts 32 --steps 150
  for p in ort-int8 ort-auto; do
    run "off_$p-ovbf16" bench offline $common --precision $p --audio-dtype ov-bf16 --num-texts 32 --steps 150
  done
  run off_int8-static-kvint8 bench offline $common --precision int8-static --kv-cache-dtype int8 --audio-dtype bf16 \
    --num-texts 32 --steps 150
  run off_fp32 bench offline $common --precision fp32 --num-texts 32 --steps 150
  run off_ort-int8-ovint8 bench offline $common --precision ort-int8 --audio-dtype ov-int8 --num-texts 32 --steps 150
  run off_int4-ovint8 bench offline $common --precision int4 --audio-dtype ov-int8 --num-texts 32 --steps 150
  # 32 streams' p99 first chunk moves with the host by ~0.2 s: 3 rounds, medians.
  run s32_int4-ovint8 bench streams $common --precision int4 --audio-dtype ov-int8 --concurrency 32 --steps 150
done
run s32_ort-int8 bench streams $common --precision ort-int8 --audio-dtype bf16 --concurrency 32 --steps 150 \
  --reference-python "$REF"
run s32_int4 bench streams $common --precision int4 --audio-dtype bf16 --concurrency 32 --steps 150
run s32_int8-static bench streams $common --precision int8-static --audio-dtype bf16 --concurrency 32 --steps 150
run s32_ort-int8-ovbf16 bench streams $common --precision ort-int8 --audio-dtype ov-bf16 --concurrency 32 --steps 150
run s32_ort-int8-ovint8 bench streams $common --precision ort-int8 --audio-dtype ov-int8 --concurrency 32 --steps 150
run s32_int8-static-kvbf16 bench streams $common --precision int8-static --kv-cache-dtype bf16 --audio-dtype bf16 \
  --concurrency 32 --steps 150
run s32_int8-static-kvint8 bench streams $common --precision int8-static --kv-cache-dtype int8 --audio-dtype bf16 \
  --concurrency 32 --steps 150
echo "done: $O" >&2
