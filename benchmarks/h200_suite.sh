#!/usr/bin/env bash
# The H200 suite: bash benchmarks/h200_suite.sh PART|NAME ... (repository root). A run ROUTINE:NAME is `python3 -m
# benchmarks ROUTINE --flagfile=configs/suite/NAME.flags`, into $OUT or bench_out/ NAME.json and NAME.log (tune: the
# tuned file). SUITE_FLAGS win over the flagfile; SMOLLM2_GGUF: the GGUF; SUITE_BUDGET: the command's wall seconds.
set -uo pipefail
declare -A PARTS=(
  [gqa]="decode:gqa"                      # the GQA sweep, every impl
  [host_loop]="decode:gqa_host_loop"      # the chain timer beside a Python loop of calls
  [rows]="decode:rows_ragged decode:rows_full decode:rows_paged16_ragged decode:rows_paged16_full"
  [paged]="decode:paged16 decode:paged64" [plans_paged]="tune:plans_both_paged16"   # plans: then rows_paged16_ragged
  [models]="decode:llama3_8b decode:qwen25_7b decode:gemma2_9b"
  [vlast]="decode:vlast_bfloat16_nov_tokens_last decode:vlast_int8_v_tokens_last
           decode:vlast_float8_e4m3fn_v_tokens_last"   # one-byte caches on triton, bf16 beside
  [mla]="mla:mla_rows mla:mla_rows_b128 mla:mla_rows_s2_h16"
  [mla_fp8]="mla:mla_fp8_bf16 mla:mla_fp8"   # an fp8 latent pool beside bf16
  [smollm2]="serving:smollm2_engine tools.smollm2_transformers:smollm2_transformers"
  [shapes]="decode:shapes_d64 decode:shapes_d80 decode:shapes_d96 decode:shapes_d128 decode:shapes_d192
            decode:shapes_d256 decode:shapes_d512"   # head dims past 64 / 128 / 256
  [shapes_more]="decode:shapes_heads32_8 decode:shapes_heads48_1 decode:shapes_heads71_1 decode:shapes_page16
                 decode:shapes_page1 decode:shapes_s4_padded decode:shapes_s4_varlen"   # MQA, page 1, varlen
  [shared]="shared_prefix:shared_prefix shared_prefix:shared_prefix_mla serving:smollm2_samples
            serving:smollm2_system_prompt"   # forked prompts, a cached system prompt
  [vmap]="vmap:vmap" [step]="step:step" [merges]="tools.kernel_variants:merges"   # merges: each priced, kernel alone
  [trace]="tools.kernel_trace:trace_stream_k tools.kernel_trace:trace_fp8"   # warpgroups' time in the kernel
  [mosaic_levers]="tools.kernel_variants:mosaic_tile_consumers tools.kernel_variants:mosaic_ragged_order
                   decode:rows_ragged_longest_first tools.kernel_variants:mosaic_stream_k_parts"   # beside rows_ragged
  [paged_one_byte]="decode:paged64_int8 decode:paged64_int8_tiles tools.mosaic_one_byte:asn_paged_fp8
                    tools.mosaic_one_byte:asn_paged_int8 tools.mosaic_one_byte:asn_paged16_fp8"   # pages 64, 16
  [one_byte_barriers]="tools.mosaic_one_byte:barriers_fp8 tools.mosaic_one_byte:barriers_int8
                       tools.mla_fp8_parts:barriers_mla"   # scale slots freed at a commit; explicit barriers
  [one_byte_chains]="tools.mosaic_one_byte:chains_fp8 tools.mosaic_one_byte:chains_int8 tools.mosaic_one_byte:tiles_fp8
                     tools.mosaic_one_byte:asn_fp8 tools.mosaic_one_byte:asn_vreg tools.mosaic_one_byte:asn_b1_fp8
                     tools.mosaic_one_byte:asn_int8 decode:asn_sweep_fp8 decode:asn_sweep_int8
                     tools.mosaic_one_byte:asn_loads tools.mosaic_one_byte:asn_persistent
                     tools.mosaic_one_byte:asn_paired tools.mosaic_one_byte:asn_load_depth"
  [tune]="tune:tune" [tune_triton]="tune:tune_triton"   # Mosaic GPU's entries of the tuned file; Triton's
  [tune_one_byte]="tune:tune_both_fp8 tune:tune_both_int8"   # both backends over one-byte caches, one run
  [plans_one_byte]="tune:plans_both_fp8 tune:plans_both_int8"   # their plans, too (SUITE_FLAGS: --cases)
  [tune_both]="tune:tune_both tune:tune_both_models" [plans_rows]="tune:plans_both_rows tools.kernel_variants:walk_loop"
  [scaling]="scaling:scaling8k scaling:scaling32k"   # several GPUs
)
out="${OUT:-bench_out}" status=0 budget=$((SECONDS + ${SUITE_BUDGET:-86400})); mkdir -p "$out"
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
run() {   # ROUTINE NAME
  local routine=$1 name=$2 args=(--flagfile="configs/suite/$2.flags") left=$((budget - SECONDS))
  ((left > 0)) || { echo "skipped $name: SUITE_BUDGET spent"; status=1; return; }
  [[ $routine == tune ]] || args+=(--json="$out/$name.json")
  [[ $routine == serving || $routine == tools.smollm2_transformers ]] &&
    args+=(--gguf="${SMOLLM2_GGUF:?set SMOLLM2_GGUF to the GGUF file}")
  # shellcheck disable=SC2086  # SUITE_FLAGS: words
  timeout "$left" python3 -m benchmarks "$routine" "${args[@]}" ${SUITE_FLAGS:-} 2>&1 |
    grep -v -e '^[IW][0-9]' -e 'Warning' | tee "$out/$name.log" || status=1
  [[ $routine != tune ]] || cp pallas_kv/tuned/*.json "$out/"
}
for arg in "$@"; do
  runs=${PARTS[$arg]:-$(printf '%s\n' ${PARTS[@]} | grep -m1 ":$arg\$")}
  [[ -n $runs ]] || { echo "unknown part: $arg; parts:" $(printf '%s\n' "${!PARTS[@]}" | sort); status=2; continue; }
  for entry in $runs; do run "${entry%%:*}" "${entry#*:}"; done
done
exit $status
