#!/usr/bin/env bash
# The measurement suite on an H200, in parts that each fit one ~10-minute command.
#   bash benchmarks/h200_suite.sh PART [PART ...]   with PART in: tests variants gqa paged quantized qprobe vmap step tune
#   fuzz memcheck mla merge balanced smollm2 (SMOLLM2_GGUF=path: the GPU machine has no network)
#   tune_triton ncu ncu_stages ncu_stalls ncu_mla mla_order mla_waits mla_clocks mla_probes mla_schedules mla_merge ptxas loadpath kernels chain timer ragged_order ragged_one stream_k stream_k_tiles rows qpaged16 qpaged64 converter vlast models stages
#   tune-SWEEP-BACKEND (e.g. TUNE_CASES=32x8192,128x8192 ... tune-gpt_oss_120b-mosaic_gpu)
#   (and scaling8k scaling32k on a machine with several GPUs)
# Results (JSON, logs) go to $OUT if set, else bench_out/. Run from the repository root with the
# machine's own python3 (jax with CUDA); nothing is installed.
set -uo pipefail
out="${OUT:-bench_out}"
mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
quiet() { grep -v -e '^[IW][0-9]' -e 'Warning'; }
status=0
for part in "$@"; do
  case "$part" in
    tests)    # three pytest processes (compiles dominate; memory allocated on demand), one log each.
              # The GPU machine has no network: SMOLLM2_GGUF=path lets the SmolLM2 test find the model
              # (the file keeps its name; its folder becomes the weights cache).
              [ -n "${SMOLLM2_GGUF:-}" ] && export PALLAS_KV_CACHE_DIR="$(dirname "$SMOLLM2_GGUF")"
              groups=("tests/test_kernels.py tests/test_sharding.py" \
                      "tests/test_quantized.py tests/test_v_tokens_last.py tests/test_mosaic_gpu.py tests/test_smollm2.py" \
                      "tests/test_mosaic_gpu_mla.py tests/test_triton.py tests/test_split_plan.py")
              for i in 0 1 2; do
                XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m pytest -q -rf -m gpu ${groups[$i]} -p no:cacheprovider \
                  > "$out/gpu_tests_$i.log" 2>&1 &
              done
              wait
              tail -qn 3 "$out"/gpu_tests_[012].log | tee "$out/gpu_tests.log" ;;
    variants) python3 -m benchmarks.kernel_variants --json="$out/variants.json" 2>&1 | quiet | tee "$out/variants.log" ;;
    loadpath) # the kernel's TMA ring with no math, under several ring shapes (~2-3 minutes)
              python3 -m benchmarks.kernel_variants --variants=none --load_path --json="$out/loadpath.json" 2>&1 \
                | quiet | tee "$out/loadpath.log" ;;
    gqa)      python3 -m benchmarks.decode --flagfile=configs/gqa_h200.flags --repeats=5 \
                --json="$out/gqa.json" 2>&1 | quiet | tee "$out/gqa.log" ;;
    quantized) # int8 / fp8 caches (per-token scales) on both kernels, dense and paged
              for kv in int8 float8_e4m3fn; do for sweep in gqa_h200 paged16_h200 paged64_h200; do
                python3 -m benchmarks.decode --flagfile=configs/$sweep.flags --impl=auto,triton,mosaic_gpu \
                  --kv_dtype=$kv --warmup=2 --repeats=5 --json="$out/${sweep}_$kv.json" 2>&1 | quiet \
                  | tee "$out/${sweep}_$kv.log"
              done; done ;;
    fuzz)     # >= 2,000 random calls per kernel backend against the reference (~8 minutes)
              for impl in mosaic_gpu triton; do
                PYTHONPATH="$PYTHONPATH:$PWD/tests" python3 tests/fuzzing.py --impl=$impl --structures=36 --draws=60 \
                  --processes=6 --time_limit=200 --rerun --invariance 2>&1 | tee "$out/fuzz_$impl.log" | grep -e '^total' -e replay
              done ;;
    memcheck) # hostile lengths and page ids under compute-sanitizer (outputs only checked to be finite)
              PYTHONPATH="$PYTHONPATH:$PWD/tests" timeout 400 compute-sanitizer --tool memcheck --leak-check no \
                python3 tests/fuzzing.py --impl=mosaic_gpu,triton --structures=12 --draws=2 --hostile --small \
                --no_reference 2>&1 | tee "$out/memcheck.log" | grep -e 'cases ok' -e 'ERROR SUMMARY'
              # shared-memory races of the kernels themselves (a few small cases; racecheck is slow)
              PYTHONPATH="$PYTHONPATH:$PWD/tests" timeout 300 compute-sanitizer --tool racecheck \
                python3 tests/fuzzing.py --impl=mosaic_gpu,triton --structures=3 --draws=1 --small \
                --no_reference 2>&1 | tee "$out/racecheck.log" | grep -e 'cases ok' -e 'ERROR SUMMARY' -e 'RACECHECK SUMMARY' ;;
    merge)    # Triton's split merge in the kernel's launch against the second launch, same run
              for m in nomerge merge; do
                python3 -m benchmarks.decode --flagfile=configs/gqa_h200.flags --impl=triton,cudnn,torch \
                  $([ $m = merge ] && echo --merge_in_kernel) --warmup=2 --repeats=5 --json="$out/gqa_$m.json" 2>&1 \
                  | quiet | tee "$out/gqa_$m.log"
              done
              python3 -m pytest -q -m gpu tests/test_triton.py -k merge 2>&1 | tail -3 ;;
    balanced) # ragged batches: the balanced split plan against the per-sequence one, with cuDNN, same run
              for plan in per_sequence balanced; do
                python3 -m benchmarks.decode --flagfile=configs/gqa_h200.flags --ragged \
                  --cases=16x32768,64x8192,128x4096,8x8192 --impl=triton,mosaic_gpu$([ $plan = per_sequence ] && echo ,cudnn) \
                  --split_plan=$plan --warmup=2 --repeats=5 --json="$out/ragged_$plan.json" 2>&1 | quiet \
                  | tee "$out/ragged_$plan.log"
              done ;;
    mla)      python3 -m benchmarks.mla --iters=10 --json="$out/mla.json" 2>&1 | quiet | tee "$out/mla.log" ;;
    mla_order) # the programs' order over the ragged batch (longest first, per-sequence and balanced
              # splits) and on two full-length rows, ring halves beside; the MLA GPU test of the orders (~7 min)
              python3 -m pytest -q -m gpu tests/test_mosaic_gpu_mla.py -k "gpu_mla_matches and 4-4096-64" \
                -p no:cacheprovider 2>&1 | tail -3 | tee "$out/mla_order_test.log"
              python3 -m benchmarks.mla --rows=h128_b128_ragged4096 --iters=10 --repeats=10 \
                --impl=mosaic_gpu,mosaic_gpu_lf,mosaic_gpu_balanced,mosaic_gpu_balanced_lf \
                --json="$out/mla_order_ragged.json" 2>&1 | quiet | tee "$out/mla_order.log"
              python3 -m benchmarks.mla --rows=h128_b64_t4096,h128_b128_t8192 --iters=10 --repeats=10 \
                --impl=mosaic_gpu,mosaic_gpu_lf,mosaic_gpu_rh,kernel,kernel_rh \
                --json="$out/mla_order_full.json" 2>&1 | quiet | tee -a "$out/mla_order.log" ;;
    mla_waits) # what the MLA loads cost: the launch alone, without loads, and with the loads but no
              # waits for them (the consumers compute on slots before they land), two rows (~3 min)
              python3 -m benchmarks.mla --rows=h128_b64_t4096,h128_b128_t8192 --iters=10 --repeats=10 \
                --impl=kernel,kernel_no_loads,kernel_late_waits --json="$out/mla_waits.json" 2>&1 | quiet \
                | tee "$out/mla_waits.log" ;;
    mla_clocks) # the SM clock and power under the MLA launch with and without its loads (nvidia-smi
              # sampled every 50 ms through each timing run; samples above 300 W summarised; ~1 min per impl;
              # CLOCKS_IMPLS picks other benchmarks.mla impls)
              for impl in ${CLOCKS_IMPLS:-kernel kernel_no_loads kernel_late_waits}; do
                nvidia-smi --query-gpu=clocks.sm,power.draw --format=csv,noheader,nounits -lms 50 \
                  > "$out/clocks_$impl.csv" & smi=$!
                python3 -m benchmarks.mla --rows=h128_b128_t8192 --iters=100 --repeats=30 --impl=$impl 2>&1 \
                  | quiet | grep ' us,' | tee -a "$out/mla_clocks.log"
                kill $smi; wait $smi 2>/dev/null
                python3 -m benchmarks.clocks "$out/clocks_$impl.csv" --label=$impl | tee -a "$out/mla_clocks.log"
              done ;;
    mla_probes) # where an MLA tile's time goes: the kernel's launch alone beside probes that leave Q K^T,
              # the softmax or P V out (results wrong by design, unchecked), and the alternate-scorer
              # schedule, two rows (~4 min)
              python3 -m benchmarks.mla --rows=h128_b64_t4096,h128_b128_t8192 --iters=10 --repeats=10 \
                --impl=mosaic_gpu,mosaic_gpu_alt,kernel,kernel_no_qk,kernel_no_softmax,kernel_no_pv,kernel_loads_only \
                --json="$out/mla_probes.json" 2>&1 | quiet | tee "$out/mla_probes.log" ;;
    mla_schedules) # the kernel's launch alone (B64 T4096) compiled as by default (mla_config.Codegen: producer
              # 24 / consumers 240 registers, Q's descriptors rebuilt every tile) and as before (_r232_heldq:
              # 40 / 232, Q's descriptors held), the alternate scorers (also with their ring slots opaque,
              # _spt, and with ring halves, _altrh) and pipeline_qk beside, with no-loads probes (~7 min)
              python3 -m benchmarks.mla --rows=h128_b64_t4096 --iters=10 --repeats=10 \
                --impl=kernel,kernel_r232_heldq,kernel_no_loads,kernel_alt,kernel_alt_spt,kernel_alt_no_loads,kernel_altrh,kernel_altrh_spt,mosaic_gpu_pqk,mosaic_gpu \
                --json="$out/mla_schedules.json" 2>&1 | quiet | tee "$out/mla_schedules.log" ;;
    mla_merge) # the MLA split merge overlapped with the kernel (the Mosaic GPU launch, programmatic dependent
              # launch) against the Triton merge the op runs, at B1 (64 splits) and B16 (4), and its GPU test (~5 min)
              python3 -m benchmarks.mla --rows=h128_b1_t32768 --iters=10 --repeats=10 \
                --impl=mosaic_gpu,kernel_sp64_triton_merge,kernel_sp64_mosaic_merge --json="$out/mla_merge_b1.json" 2>&1 \
                | quiet | tee "$out/mla_merge.log"
              python3 -m benchmarks.mla --rows=h128_b16_t4096 --iters=10 --repeats=10 \
                --impl=mosaic_gpu,kernel_sp4_triton_merge,kernel_sp4_mosaic_merge --json="$out/mla_merge_b16.json" 2>&1 \
                | quiet | tee -a "$out/mla_merge.log"
              python3 -m pytest -q -m gpu tests/test_mosaic_gpu_mla.py -k split_merge -p no:cacheprovider 2>&1 | tail -3 ;;
    ptxas)    # registers, spills and wgmma warnings of the MLA schedules, from ptxas (compiles only,
              # ~40 s a kernel); their gzipped PTX comes back as one ptx.tar (the device returns few
              # files) for `--ptx` on a machine without a GPU
              python3 -m benchmarks.ptxas_summary --dump_dir=/tmp/ptxas_dump --keep_ptx=/tmp/ptx \
                --compile=kernel,kernel_r232_heldq,kernel_rh,kernel_alt,kernel_alt_spt,kernel_altrh_spt,mosaic_gpu_pqk 2>&1 \
                | quiet | tee "$out/ptxas.log"
              tar cf "$out/ptx.tar" -C /tmp ptx && rm -rf /tmp/ptxas_dump /tmp/ptx ;;
    kernels)  # every kernel of one call and its GPU us (torch.profiler), ours and the peers, per shape
              for c in 1x32768 8x8192 32x4096 128x4096; do
                python3 -m benchmarks.profile_kernel --kernel_times --flagfile=configs/gqa_h200.flags \
                  --impl=triton,mosaic_gpu,cudnn,torch --cases=$c 2>&1 | quiet | tee -a "$out/kernels.log"
              done ;;
    chain)    # the GPU's busy time per call inside the chain timer's program (10, 40, 80 calls), then
              # the timer on the same cases: what the chain-diff adds over the GPU time
              for c in 32x4096 128x4096; do for n in 10 40 80; do
                python3 -m benchmarks.profile_kernel --kernel_times --chain_calls=$n --flagfile=configs/gqa_h200.flags \
                  --impl=triton,cudnn --cases=$c 2>&1 | quiet | tee -a "$out/chain.log"
              done; done
              python3 -m benchmarks.decode --flagfile=configs/gqa_h200.flags --impl=triton,cudnn,torch \
                --cases=32x4096,128x4096 --warmup=2 --repeats=7 --json="$out/chain_timer.json" 2>&1 | quiet \
                | tee -a "$out/chain.log" ;;
    timer)    # the chain-diff timer plain and queued behind a lead run, beside the GPU busy time per call
              for c in 1x32768 8x8192 32x4096 128x4096; do
                python3 -m benchmarks.profile_kernel --timer_check --flagfile=configs/gqa_h200.flags \
                  --impl=triton,cudnn --cases=$c 2>&1 | quiet | tee -a "$out/timer.log"
              done ;;
    models)   # auto against the best kernel backend on the model sweeps (MODELS="..." picks flagfiles of
              # configs/, e.g. gqa_h200_heldout; ~2-3 min each)
              for m in ${MODELS:-llama3_8b qwen25_7b gemma2_9b}; do
                python3 -m benchmarks.decode --flagfile=configs/$m.flags --impl=auto,triton,mosaic_gpu \
                  --warmup=2 --repeats=5 --json="$out/$m.json" 2>&1 | quiet > "$out/$m.log"
                python3 -m benchmarks.report "$out/$m.json" --auto | tee -a "$out/models_auto.log"
              done ;;
    stages)   # the Triton kernel's pipelined tiles, 3 against 2, over batch at 8K at group 4 (Llama-3-8B)
              # and group 7 (Qwen-2.5-7B), the tuned file set aside (PALLAS_KV_TUNED_DIR names a folder
              # that does not exist: no tuned entries; ~3 min). STAGES_MODELS, STAGES_CASES and
              # STAGES_EXTRA (more benchmarks.decode flags, e.g. --ragged) pick other sweeps.
              for m in ${STAGES_MODELS:-llama3_8b qwen25_7b}; do for st in 2 3; do
                PALLAS_KV_TUNED_DIR="$out/no_tuned_configs" python3 -m benchmarks.decode --flagfile=configs/$m.flags --impl=triton \
                  --cases=${STAGES_CASES:-8x8192,32x8192,64x8192,128x8192,256x8192} --triton_num_stages=$st \
                  ${STAGES_EXTRA:-} --warmup=2 --repeats=7 --json="$out/stages_${m}_$st.json" 2>&1 | quiet \
                  | tee "$out/stages_${m}_$st.log"
              done; done ;;
    vlast)    # one-byte caches on triton with v stored tokens last (v_tokens_last) and like k, bf16
              # beside (~7 minutes)
              for variant in bfloat16:nov_tokens_last int8:v_tokens_last float8_e4m3fn:v_tokens_last \
                             int8:nov_tokens_last float8_e4m3fn:nov_tokens_last; do
                IFS=: read -r kv layout <<< "$variant"
                name="vlast_${kv}_$layout"
                python3 -m benchmarks.decode --flagfile=configs/gqa_h200.flags --impl=triton --kv_dtype=$kv \
                  --$layout --warmup=2 --repeats=5 --json="$out/$name.json" 2>&1 | quiet | tee "$out/$name.log"
              done ;;
    qpaged16|qpaged64) # paged caches of pages 16 or 64 on triton: bf16, and int8 / fp8 e4m3 (per-token
              # scales) with v like k and v tokens last; page 16 int8 tokens last also with 128-token tiles (~5 min)
              ps=${part#qpaged}
              for variant in bfloat16:nov_tokens_last int8:nov_tokens_last float8_e4m3fn:nov_tokens_last \
                             int8:v_tokens_last float8_e4m3fn:v_tokens_last $([ "$ps" = 16 ] && echo int8:v_tokens_last:128); do
                IFS=: read -r kv layout tiles <<< "$variant"
                name="qpaged${ps}_${kv}_$layout${tiles:+_bkv$tiles}"
                python3 -m benchmarks.decode --flagfile=configs/paged${ps}_h200.flags --impl=triton --kv_dtype=$kv \
                  --$layout ${tiles:+--triton_block_kv=$tiles} --warmup=2 --repeats=5 --json="$out/$name.json" 2>&1 \
                  | quiet | tee "$out/$name.log"
              done ;;
    converter) # one-byte caches on mosaic_gpu with and without the converter warpgroup, triton beside
              for kv in int8 float8_e4m3fn; do for cvt in noconvert_warpgroup convert_warpgroup; do
                python3 -m benchmarks.decode --flagfile=configs/gqa_h200.flags --impl=mosaic_gpu$([ $cvt = noconvert_warpgroup ] && echo ,triton) \
                  --kv_dtype=$kv --$cvt --warmup=2 --repeats=5 --json="$out/converter_${kv}_$cvt.json" 2>&1 | quiet \
                  | tee "$out/converter_${kv}_$cvt.log"
              done; done ;;
    ragged_order) # ragged batches with the sequences in batch order, longest first and long-short (triton), cuDNN
              # beside; then the same shapes at full length in batch order and longest first (the order's own
              # cost). ORDER_CASES picks other shapes (e.g. held-out ones).
              for order in given longest_first long_short full_given full_longest_first; do
                python3 -m benchmarks.decode --flagfile=configs/gqa_h200.flags $([[ $order = full_* ]] || echo --ragged) \
                  --cases=${ORDER_CASES:-16x32768,64x8192,128x4096} --impl=triton$([ $order = given ] && echo ,cudnn) \
                  --sequence_order=${order#full_} --warmup=2 --repeats=5 --json="$out/ragged_$order.json" 2>&1 | quiet \
                  | tee "$out/ragged_$order.log"
              done ;;
    stream_k) # the stream-K plan (triton) at 2 and 3 programs per SM against per-sequence splits, cuDNN
              # beside: ragged, then the same shapes at full length (STREAMK_CASES: other shapes); ~6 min
              for setting in ragged:per_sequence: ragged:stream_k:2 ragged:stream_k:3 \
                             full:per_sequence: full:stream_k:2 full:stream_k:3; do
                IFS=: read -r lengths plan per_sm <<< "$setting"
                name=${lengths}_${plan}${per_sm}
                python3 -m benchmarks.decode --flagfile=configs/gqa_h200.flags $([ $lengths = ragged ] && echo --ragged) \
                  --cases=${STREAMK_CASES:-16x32768,64x8192,128x4096} \
                  --impl=triton$([ $plan = per_sequence ] && echo ,cudnn) --split_plan=$plan \
                  ${per_sm:+--stream_k_programs_per_sm=$per_sm} --warmup=2 --repeats=5 \
                  --json="$out/stream_k_$name.json" 2>&1 | quiet | tee "$out/stream_k_$name.log"
              done ;;
    rows)     # the issue rows: ragged batches and the same shapes at full length, dense (cuDNN beside) and
              # paged page 16, auto beside each kernel backend (~5 min)
              for l in ragged full; do
                python3 -m benchmarks.decode --flagfile=configs/gqa_h200.flags $([ $l = ragged ] && echo --ragged) \
                  --cases=16x32768,64x8192,128x4096 --impl=auto,triton,mosaic_gpu,cudnn --warmup=2 --repeats=5 \
                  --json="$out/rows_$l.json" 2>&1 | quiet | tee "$out/rows_$l.log"
                python3 -m benchmarks.decode --flagfile=configs/paged16_h200.flags $([ $l = ragged ] && echo --ragged) \
                  --cases=16x32768,64x8192,128x4096 --impl=auto,triton,mosaic_gpu --warmup=2 --repeats=5 \
                  --json="$out/rows_paged16_$l.json" 2>&1 | quiet | tee "$out/rows_paged16_$l.log"
              done ;;
    stream_k_tiles) # stream-K with 64-token tiles at three stages (two programs resident per SM) against
              # the tuned 128-token tiles (one per SM), ragged and full length (~3 min)
              for lengths in ragged full; do for tiles in tuned 64; do
                python3 -m benchmarks.decode --flagfile=configs/gqa_h200.flags $([ $lengths = ragged ] && echo --ragged) \
                  --cases=${STREAMK_CASES:-64x8192,128x4096,96x4096} --impl=triton --split_plan=stream_k \
                  $([ $tiles = 64 ] && echo --triton_block_kv=64 --triton_num_stages=3) --warmup=2 --repeats=5 \
                  --json="$out/stream_k_tiles_${lengths}_$tiles.json" 2>&1 | quiet | tee "$out/stream_k_tiles_${lengths}_$tiles.log"
              done; done ;;
    ragged_one) # one triton setting for every ragged row: the balanced plan with the merge in the kernel's
              # launch (batch order, longest first) against per-sequence splits, cuDNN and the full-length
              # batch beside (~4 min)
              for setting in full:per_sequence:given: given:per_sequence:given balanced_merged:balanced:given \
                             balanced_merged_longest:balanced:longest_first; do
                IFS=: read -r name plan order <<< "$setting"
                python3 -m benchmarks.decode --flagfile=configs/gqa_h200.flags $([ $name = full ] || echo --ragged) \
                  --cases=16x32768,64x8192,128x4096 --impl=triton$([ $name = given ] && echo ,cudnn) \
                  --split_plan=$plan --sequence_order=$order $([ $plan = balanced ] && echo --merge_in_kernel) \
                  --warmup=2 --repeats=5 --json="$out/ragged_one_$name.json" 2>&1 | quiet | tee "$out/ragged_one_$name.log"
              done ;;
    smollm2)  # the engine at 1K / 4K / 8K context with auto, xla and cuDNN attention (~9 minutes), then
              # transformers on the same GGUF (needs the gguf wheel on the machine)
              python3 -m benchmarks.smollm2 --gguf="${SMOLLM2_GGUF:?set SMOLLM2_GGUF to the GGUF file}" \
                --context=8192,4096,1024 --batch=16,64,1 --impl=auto,xla,cudnn --json="$out/smollm2.json" 2>&1 \
                | quiet | grep -v '^step' | tee "$out/smollm2.log"
              python3 -m benchmarks.smollm2_transformers --gguf="$SMOLLM2_GGUF" --context=8192,4096,1024 \
                --batch=16,64,1 --json="$out/smollm2_transformers.json" 2>&1 | grep '^B=' | tee "$out/smollm2_transformers.log" ;;
    vmap)     python3 -m benchmarks.vmap --json="$out/vmap.json" 2>&1 | quiet | tee "$out/vmap.log" ;;
    qprobe)   python3 -m benchmarks.quantized_probe --json="$out/qprobe.json" 2>&1 | quiet | tee "$out/qprobe.log" ;;
    paged)    for ps in 16 64; do
                python3 -m benchmarks.decode --flagfile=configs/paged${ps}_h200.flags --repeats=5 \
                  --json="$out/paged$ps.json" 2>&1 | quiet | tee "$out/paged$ps.log"
              done ;;
    step)     # ~35 s per row (two chain compiles of the layer): 12 rows
              python3 -m benchmarks.step --impl=auto,xla --batch=1,32,128 --context=1024,32768 \
                --json="$out/step.json" 2>&1 | quiet | tee "$out/step.log" ;;
    tune|tune_triton)   # ~1 minute per shape; merges into the package's tuned file, copied to $out
              backend=$([ "$part" = tune ] && echo mosaic_gpu || echo triton)
              python3 -m benchmarks.tune --flagfile=configs/gqa_h200.flags --backend=$backend --repeats=5 \
                --warmup=2 2>&1 | quiet | tee "$out/$part.log"
              cp pallas_kv/tuned/*.json "$out/" ;;
    tune-*)   # tune-SWEEP-BACKEND: tune a configs/SWEEP.flags sweep (TUNE_CASES=BxT,... picks cases;
              # ~1 minute per shape with the fast space), e.g. tune-gpt_oss_120b-triton
              spec=${part#tune-}; backend=${spec##*-}; sweep=${spec%-*}
              python3 -m benchmarks.tune --flagfile="configs/$sweep.flags" --backend="$backend" \
                ${TUNE_CASES:+--cases=$TUNE_CASES} --repeats=5 --warmup=2 2>&1 | quiet | tee "$out/$part.log"
              cp pallas_kv/tuned/*.json "$out/" ;;
    ncu_stalls) # why a warp waits, per issued instruction, with DRAM % and issue activity: the Triton
              # kernel at B128 T4096 on a bf16 cache and on one-byte caches stored tokens last (~2.5 min)
              if ! command -v ncu >/dev/null 2>&1; then echo "ncu: not on this machine" | tee "$out/ncu_stalls.log"; else
                mkdir -p /tmp/ncu_stalls
                metrics=$(python3 -m benchmarks.ncu_summary --metrics_flag)
                for variant in bfloat16:nov_tokens_last int8:v_tokens_last float8_e4m3fn:v_tokens_last; do
                  IFS=: read -r kv layout <<< "$variant"
                  timeout 150 ncu --clock-control none --kernel-name regex:'pallas_kv_triton_decode' --launch-skip 3 \
                    --launch-count 1 --metrics "$metrics" --csv python3 -m benchmarks.profile_kernel \
                    --flagfile=configs/gqa_h200.flags --impl=triton --kv_dtype=$kv --$layout --cases=128x4096 \
                    --warmup=2 --calls=3 > "/tmp/ncu_stalls/${kv}_$layout.csv" 2> /tmp/ncu_stalls/err.log \
                    || tail -3 /tmp/ncu_stalls/err.log
                done
                python3 -m benchmarks.ncu_summary /tmp/ncu_stalls/*.csv | tee "$out/ncu_stalls.log"
              fi ;;
    ncu_mla)  # the MLA kernel (128 heads, page 64) under Nsight Compute: how busy the tensor pipe is, the L2
              # hit rate (a sequence's two row blocks read the same tiles), why warps wait (~3 min)
              if ! command -v ncu >/dev/null 2>&1; then echo "ncu: not on this machine" | tee "$out/ncu_mla.log"; else
                mkdir -p /tmp/ncu_mla
                metrics=$(python3 -m benchmarks.ncu_summary --metrics_flag --pipes)
                for c in 64x4096 128x8192; do
                  timeout 170 ncu --clock-control none --kernel-name regex:'pallas_kv_mla' --launch-skip 3 \
                    --launch-count 1 --metrics "$metrics" --csv python3 -m benchmarks.profile_kernel \
                    --flagfile=configs/mla_h200.flags --impl=mosaic_gpu --cases=$c --warmup=2 --calls=3 \
                    > "/tmp/ncu_mla/$c.csv" 2> /tmp/ncu_mla/err.log || tail -3 /tmp/ncu_mla/err.log
                done
                python3 -m benchmarks.ncu_summary /tmp/ncu_mla/*.csv | tee "$out/ncu_mla.log"
              fi ;;
    ncu_stages) # Nsight Compute on the Triton kernel at 2 and 3 stages where 3 lose at full length (Llama-3-8B
              # B64 T8192: 469.6 against 544.3 us; 5 and 3 programs per SM), tuned file set aside: achieved
              # occupancy, DRAM throughput, SMEM per block (~4 min)
              if ! command -v ncu >/dev/null 2>&1; then echo "ncu: not on this machine" | tee "$out/ncu_stages.log"; else
                mkdir -p /tmp/ncu_stages
                for st in 2 3; do
                  PALLAS_KV_TUNED_DIR="$out/no_tuned_configs" timeout 170 ncu --clock-control none --target-processes all \
                    --kernel-name regex:'pallas_kv' --launch-skip 3 --launch-count 1 --section LaunchStats \
                    --section Occupancy --section SpeedOfLight --export "/tmp/ncu_stages/triton-st$st" --force-overwrite \
                    python3 -m benchmarks.profile_kernel --flagfile=configs/llama3_8b.flags --impl=triton --cases=64x8192 \
                    --triton_num_stages=$st --warmup=2 --calls=3 2>&1 | tail -3
                  [ -f "/tmp/ncu_stages/triton-st$st.ncu-rep" ] && ncu --import "/tmp/ncu_stages/triton-st$st.ncu-rep" \
                    --page details --csv > "/tmp/ncu_stages/triton-st$st.csv"
                done
                python3 -m benchmarks.ncu_summary /tmp/ncu_stages/*.csv | tee "$out/ncu_stages.log"
              fi ;;
    ncu)      # Nsight Compute counters of one steady-state call (registers, smem, occupancy, DRAM %);
              # a profiled process takes minutes (compiles run under ncu), so each one has its own limit.
              if ! command -v ncu >/dev/null 2>&1; then echo "ncu: not on this machine" | tee "$out/ncu.log"; else
                mkdir -p /tmp/ncu
                for c in 128x4096; do for impl in triton mosaic_gpu torch; do
                  timeout 170 ncu --clock-control none --target-processes all --kernel-name regex:'pallas_kv|flash|fmha|sdpa' \
                    --launch-skip 3 --launch-count 1 --section LaunchStats --section Occupancy \
                    --section SpeedOfLight --export "/tmp/ncu/$impl-$c" --force-overwrite \
                    python3 -m benchmarks.profile_kernel --flagfile=configs/gqa_h200.flags --impl=$impl \
                    --cases=$c --warmup=2 --calls=3 2>&1 | tail -3
                  [ -f "/tmp/ncu/$impl-$c.ncu-rep" ] && ncu --import "/tmp/ncu/$impl-$c.ncu-rep" --page details --csv > "/tmp/ncu/$impl-$c.csv"
                done; done
                python3 -m benchmarks.ncu_summary /tmp/ncu/*.csv | tee "$out/ncu.log"
                tar czf "$out/ncu_csv.tgz" -C /tmp/ncu $(cd /tmp/ncu && ls *.csv)
              fi ;;
    scaling8k|scaling32k)
              ctx=$([ "$part" = scaling8k ] && echo 8192 || echo 32768)
              python3 -m benchmarks.scaling --flagfile=configs/scaling_h200.flags --seq_len=$ctx \
                --json="$out/$part.json" 2>&1 | quiet | tee "$out/$part.log" ;;
    *) echo "unknown part: $part (tests variants loadpath gqa paged quantized qprobe vmap fuzz memcheck mla merge balanced smollm2 step tune tune_triton tune-SWEEP-BACKEND ncu ncu_stalls ncu_mla mla_probes mla_schedules kernels chain timer ragged_order stream_k stream_k_tiles rows converter models scaling8k scaling32k)"; status=2 ;;
  esac
done
exit $status
