#!/usr/bin/env bash
# The GPU rows of the benchmarks page (docs/benchmarks.md), each stage the command that produced one. From the project's root, on a
# machine with a CUDA GPU and the project installed:
#
#   bash benchmarks/gpu_table.sh [STAGE ...]      (default: every stage, in this order)
#
# Stages: tests (or cuda_tests, the GPU-relevant part) w6 w6_long w6_sync reader memory instances llm_instances
# w6_floor w6_chunks w6_expandable w6_threads w6_ahead w6_ahead1 llm_1inst llm_3inst host_bound serving serving_threads w1 w1_train w7,
# and next, next2 (the stages the benchmarks page names for the next GPU run, in two calls)
# Results go to benchmarks/results/*_gpu*.json, each stage's output to $LOGS/<stage>.log. Each stage
# is time-capped (seconds in the table below) so that one that hangs cannot take the others' time;
# $AFTER (a shell command) runs after each stage, e.g. to copy the results somewhere as they come.
# The LLM rows use a Qwen2.5-1.5B-shaped causal LM with random weights (benchmarks/shapes.py) and
# the LLM example's smoke tokenizer and held-out corpus (`--tiny`): the cost of a real forward pass
# and a 152k vocabulary, not a trained model's outputs.
#
# Device time is scarce, so try a list on the CPU first: SMOKE=1 runs every stage's own command on
# the tiny shape with a few sequences and one repetition (the sizes in smoke_args), results and logs
# under a temporary directory, and says which stages failed:
#
#   SMOKE=1 bash benchmarks/gpu_table.sh next next2
set -u
PY=${PY:-python}
SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then
  SMOKE_DIR=${SMOKE_DIR:-$(mktemp -d /tmp/gpu-table-smoke.XXXXXX)}
  export DISTILL_BENCH_RESULTS=$SMOKE_DIR/results
  LOGS=${LOGS:-$SMOKE_DIR/logs}
  DEVICE=${DEVICE:-cpu}
  SHAPE=${SHAPE:-qwen2.5-tiny}
  DTYPE=${DTYPE:-FP32}
  echo "smoke run: $DEVICE, $SHAPE, $DTYPE; results and logs under $SMOKE_DIR"
fi
LOGS=${LOGS:-benchmarks/results/gpu-logs}
DEVICE=${DEVICE:-cuda}
SHAPE=${SHAPE:-qwen2.5-1.5b}  # benchmarks/shapes.py
SHAPES=${SHAPES:-/tmp/distill-shapes}
Q15=$SHAPES/$SHAPE
DTYPE=${DTYPE:-BF16}
REPS=${REPS:-3}  # repetitions of the LLM rows and the instance counts
FAILED=()
mkdir -p "$LOGS"

smoke_args() {  # smoke_args PYTHON -m MODULE ...: the small sizes SMOKE=1 appends (argparse: the last one wins)
  [ "$SMOKE" = 1 ] || return 0
  case $3 in
    # (batch 4: the in-process loops hold a whole batch's logits, 3 of them at llm_3inst)
    benchmarks.llm_serving) echo --sequences 24 --batch 4 --clients 8 --student-batch 4 --reader-rows 8 --reps 1 \
                              --compute-dtype "$DTYPE" ;;
    # (a few positions: each one's logits are the whole 152k vocabulary)
    benchmarks.host_bound) echo --shapes 2x8,3x16 --reps 1 --compute-dtype "$DTYPE" ;;
    benchmarks.teacher_memory) echo --seq 256 --compute-dtype "$DTYPE" ;;
    benchmarks.serving) echo --reps 1 --warmup 0.2 --duration 0.5 --compute-dtype "$DTYPE" ;;
    benchmarks.instances)  # ResNet-50 needs torchvision (the GPU image has it); without it, RefTeacher
      $PY -c 'import torchvision' 2>/dev/null || echo --model examples.refteacher:build
      echo --counts 1,2 --batch 4 --clients 8 --inproc-batch 8 --max-batch-size 8 --duration 0.5 --reps 1 \
        --compute-dtype "$DTYPE" ;;
    benchmarks.onpolicy) echo --shape tiny --batch 4 --prompt-len 16 --new-tokens 8 --steps 2 --reps 1 \
                           --compute-dtype "$DTYPE" ;;
    benchmarks.w1_train) echo --batch 8 --steps 3 --reps 1 --compute-dtype "$DTYPE" ;;
    benchmarks.mesh) echo --reps 1 --steps 10 --compute-dtype "$DTYPE" ;;
  esac
}

stage() {  # stage NAME SECONDS COMMAND...
  local name=$1 limit=$2; shift 2
  local start; start=$(date +%s)
  local extra; extra=$(smoke_args "$@")
  # shellcheck disable=SC2086 # the smoke sizes are words
  set -- "$@" $extra
  echo "== $name (at most ${limit} s): $*"
  timeout -k 10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc after $(( $(date +%s) - start )) s"
  [ "$rc" = 0 ] || FAILED+=("$name")
  tail -n "${TAIL:-18}" "$LOGS/$name.log"
  eval "${AFTER:-true}"
}

shape() {  # the random-weight $SHAPE (Qwen2.5-1.5B), with the smoke tokenizer (trained here if missing)
  [ -f "$Q15/config.json" ] && return 0
  $PY -m benchmarks.shapes "$SHAPE" --tokenizer smoke --out "$Q15" --device "$DEVICE" --dtype "$DTYPE" && return 0
  FAILED+=("shape"); return 1
}

LLM=(--tiny --teacher "$Q15" --device "$DEVICE" --compute-dtype "$DTYPE" --batch 256 --clients 256 --sequences 512)

run_stage() {
  case $1 in
    tests)  # the suite on a CUDA machine (teacher-servers default to the GPU); peers needing their own
            # virtualenvs or a cluster are left out
      stage tests 300 $PY -m pytest -q -n "${JOBS:-14}" -p no:cacheprovider --timeout 240 tests \
        --ignore=tests/test_triton_peer.py --ignore=tests/test_perf_analyzer.py --ignore=tests/test_trl_client.py \
        --ignore=tests/test_trl_trainer.py --ignore=tests/test_packaging.py --ignore=tests/test_deploy.py \
        --ignore=tests/test_deploy_etcd_tls.py --ignore=tests/test_deploy_llm.py --ignore=tests/test_deploy_render.py \
        --ignore=tests/test_deploy_llm_serve.py --ignore=tests/test_autoscale_kubernetes.py ;;
    cuda_tests)  # the tests whose teachers and models run on the GPU when there is one
      stage cuda_tests 150 $PY -m pytest -q -n "${JOBS:-14}" -p no:cacheprovider --timeout 120 \
        tests/test_hf_scoring.py tests/test_hf_teacher.py tests/test_output_transforms.py \
        tests/test_padded_batching.py tests/test_row_rebatching.py tests/test_staging.py tests/test_teacher_server.py \
        tests/test_reader_sequences.py tests/test_transform_registry.py tests/test_onpolicy.py tests/test_vllm_api.py tests/test_device_memory.py ;;
    shape) shape ;;  # a shell function, so no time cap of its own
    w6) shape && stage w6 240 $PY -m benchmarks.llm_serving "${LLM[@]}" --reps "$REPS" --out llm_serving_gpu ;;
    w6_long)  # W6 with twice the sequences a pass (the start and end of a pass weigh half as much)
              # and without the buckets-off server, for more repetitions in the same time
      shape && stage w6_long 240 $PY -m benchmarks.llm_serving "${LLM[@]}" --sequences 1024 --skip-buckets-off \
        --reps "${W6_REPS:-5}" --out llm_serving_gpu_long ;;
    w6_chunks)  # A/B of the output transforms' chunk size (the 256 MiB default against 64) in W6's headline layout
                # (1 instance against 1 in-process loop), and the transforms' memory at 8k tokens
      shape && stage w6_chunks 240 $PY -m benchmarks.llm_serving "${LLM[@]}" --sequences 1024 --skip-buckets-off \
        --instances 1 --alt-server-arg=--output-chunk-mb=64 --reps "$REPS" --out llm_serving_gpu_chunks
      stage memory_chunks 150 $PY -m benchmarks.teacher_memory --device "$DEVICE" --compute-dtype "$DTYPE" \
        --teacher "$Q15" --seq 8192 --out teacher_memory_gpu_8k_chunk256 ;;
    w6_floor)  # A/B of the padding floor lowered by the batches' fitted fixed cost (the GPU default) against the
               # floor as set, in W6's headline layout; each repetition records the server's fit (batch_cost)
      shape && stage w6_floor 240 $PY -m benchmarks.llm_serving "${LLM[@]}" --sequences 1024 --skip-buckets-off \
        --instances 1 --alt-server-arg=--no-cost-aware-floor --reps "$REPS" --out llm_serving_gpu_floor ;;
    w6_expandable)  # W6's headline layout with the caching allocator's expandable segments, server and
                    # in-process loop alike (the variable-shaped batches then grow segments instead of
                    # allocating and freeing new ones): the follow-up if the allocator's retries grow
      shape && PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True stage w6_expandable 240 $PY -m benchmarks.llm_serving \
        "${LLM[@]}" --sequences 1024 --skip-buckets-off --instances 1 --reps "$REPS" --out llm_serving_gpu_expandable ;;
    w6_ahead)  # A/B at the GPU default of 2 instances: --batches-ahead 2 against the default 3 an instance
      shape && stage w6_ahead 240 $PY -m benchmarks.llm_serving "${LLM[@]}" --sequences 1024 --skip-buckets-off \
        --instances 2 --alt-server-arg=--batches-ahead=2 --reps "$REPS" --out llm_serving_gpu_ahead ;;
    w6_threads)  # W6's headline layout (1 instance) with 2 host torch threads against the default (cores / instances):
                 # on the H200 the W2 server served 1.69x the samples at 2 threads, its cores spinning at 8
      shape && stage w6_threads 240 $PY -m benchmarks.llm_serving "${LLM[@]}" --sequences 1024 --skip-buckets-off \
        --instances 1 --alt-server-arg=--threads=2 --reps "$REPS" --out llm_serving_gpu_threads ;;
    w6_ahead1)  # the same A/B with 1 instance and the cost-aware rules (an emulated device with the H100's 45 ms a
                # forward pass: 2 ahead 0.911 of length-sorted batches, 3 ahead 0.894; batching_sim)
      shape && stage w6_ahead1 240 $PY -m benchmarks.llm_serving "${LLM[@]}" --sequences 1024 --skip-buckets-off \
        --instances 1 --alt-server-arg=--batches-ahead=2 --reps "$REPS" --out llm_serving_gpu_ahead1 ;;
    llm_3inst) shape && stage llm_3inst 240 $PY -m benchmarks.llm_serving "${LLM[@]}" --sequences 1024 \
                 --skip-buckets-off --instances 3 --reps "$REPS" --out llm_serving_gpu_3inst ;;
    llm_1inst) shape && stage llm_1inst 200 $PY -m benchmarks.llm_serving "${LLM[@]}" --sequences 1024 \
                 --skip-buckets-off --instances 1 --reps "$REPS" --out llm_serving_gpu_1inst ;;
    reader) shape && stage reader 200 $PY -m benchmarks.llm_serving "${LLM[@]}" --mode reader --student-batch 16 \
              --reps "$REPS" --out llm_reader_gpu ;;
    memory)
      shape && stage memory_4k 150 $PY -m benchmarks.teacher_memory --device "$DEVICE" --compute-dtype "$DTYPE" \
        --teacher "$Q15" --seq 4096 --out teacher_memory_gpu_4k
      stage memory_8k 150 $PY -m benchmarks.teacher_memory --device "$DEVICE" --compute-dtype "$DTYPE" \
        --teacher "$Q15" --seq 8192 --out teacher_memory_gpu_8k ;;
    instances) stage instances 200 $PY -m benchmarks.instances --device "$DEVICE" --compute-dtype FP16 \
                 --model benchmarks.cv_teacher:resnet50 --counts 1,2,3 --reps "$REPS" --out instances_gpu_resnet50 ;;
    llm_instances) shape && stage llm_instances 240 $PY -m benchmarks.llm_serving "${LLM[@]}" --reps "$REPS" \
                     --instances 2 --skip-buckets-off --out llm_serving_gpu_2inst ;;
    serving) stage serving 200 $PY -m benchmarks.serving --device "$DEVICE" --compute-dtype FP16 --quick --out serving_gpu ;;
    serving_threads)  # W2/W3 with 2 host torch threads an instance, then at the default (cores / instances, 8 on
                      # 16 cores), back to back on one machine: whether the cores W2's server keeps busy (11.3 on
                      # an H200 at 8 threads, 3.8 on an H100 at 2) are intra-op threads spinning on host work
      stage serving_threads 200 $PY -m benchmarks.serving --device "$DEVICE" --compute-dtype FP16 --quick --threads 2 \
        --out serving_gpu_threads2
      stage serving_threads_default 200 $PY -m benchmarks.serving --device "$DEVICE" --compute-dtype FP16 --quick \
        --out serving_gpu ;;
    serving_split)  # W2/W3 on the host's CPU as this project's 2-core machine runs them, but with the load
                    # generator on cores of its own: servers and in-process loops on 0-1, the client on 2-5
      stage serving_split 200 $PY -m benchmarks.serving --server-cpus 0-1 --client-cpus 2-5 --reps "${SPLIT_REPS:-5}" \
        --out serving_cpu_split ;;
    w1) stage w1 200 $PY -m benchmarks.mesh --only w1 --device "$DEVICE" --compute-dtype FP16 --quick ;;
    w1_train) stage w1_train 240 $PY -m benchmarks.w1_train --device "$DEVICE" --compute-dtype FP16 --reps "$REPS" ;;
    w7) stage w7 200 $PY -m benchmarks.onpolicy --device "$DEVICE" --compute-dtype "$DTYPE" --shape qwen2.5-1.5b \
          --batch 32 --prompt-len 64 --new-tokens 64 --steps 8 --reps "$REPS" --out onpolicy_gpu \
          --w6-results benchmarks/results/llm_serving_gpu.json ;;
    host_bound)  # one batch on the host and on the device: forward pass, transforms at 256/64/1024 MiB chunks
                 # and the in-process whole-batch top-k, and the calls that make the host wait for the GPU
      shape && stage host_bound 120 $PY -m benchmarks.host_bound --teacher "$Q15" --device "$DEVICE" \
        --compute-dtype "$DTYPE" --reps "$REPS" --out host_bound_gpu ;;
    w6_sync) shape && stage w6_sync 240 $PY -m benchmarks.llm_serving "${LLM[@]}" --reps "$REPS" \
               --server-arg=--no-async-outputs --out llm_serving_gpu_sync ;;
    next)  # what the benchmarks page names for the next GPU run: one call of at most 600 s at REPS=3 (the H200's
           # stages took 135-140 s each, the shape 20 s): the thread A/B, then the batches-ahead A/B again
      for s in w6_threads w6_ahead1; do run_stage "$s"; done ;;
    next2)  # the 2-instance layout with more repetitions (about 240 s), then W2/W3 with the client apart (about 120 s)
      for s in w6_long serving_split; do run_stage "$s"; done ;;
    *) echo "unknown stage $1"; FAILED+=("$1"); return 2 ;;
  esac
}

[ $# -gt 0 ] || set -- tests w6 reader memory instances llm_instances serving w1 w1_train w7
for s in "$@"; do run_stage "$s"; done
if [ ${#FAILED[@]} -gt 0 ]; then echo "failed: ${FAILED[*]}"; exit 1; fi
echo "every stage exited 0"
