# Runs `ddp_bench --quick` and checks what it promises: exit 0 (which ddp_bench only gives when
# every variant has a positive finite median and every memory job reported), the summary's ratio
# labels, and the output files. Usage: cmake -DBENCH=path/to/ddp_bench -DOUT=dir -P check_quick.cmake
file(REMOVE_RECURSE ${OUT})
execute_process(COMMAND ${BENCH} --quick --out ${OUT}
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err TIMEOUT 110)
message("${out}")
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "ddp_bench --quick failed (${rc}):\n${err}")
endif()
foreach(label "allreduce of float32 at world 2" "naive_check" "ours/ours_gloo" "ours/reducer" "ours/local" "overlap" "peak RSS" "steady" "ours_join/ours" "ours_detail/ours"
              "ours_auto/ours@" "x/reducer+fp16" "ours+powersgd4"
              "ours+zero_adam         optimizer state per rank at world 1"
              "ours+zero_adam_overlap optimizer state per rank at world 2"
              "ours+zero_adam/ours+adam" "ours+zero_adam_overlap/ours+adam")
  string(FIND "${out}" "${label}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "the summary does not print '${label}'")
  endif()
endforeach()
foreach(file results.csv results.json steps_mlp_b4_w1.png steps_mlp_b4_w2.png allreduce_w2.json allreduce_w2.png)
  if(NOT EXISTS ${OUT}/${file})
    message(FATAL_ERROR "ddp_bench --quick did not write ${file}")
  endif()
endforeach()
# One CSV row per variant and world: 4 naive/local + 2 x 5 bucket sizes + ours_gloo + ours_view +
# 9 features (join, detail, auto, optimizer, adam, zero_adam, zero_adam_overlap, fsdp_adam,
# fsdp_adam+prefetch) + 5 hooks = 30 per world.
file(STRINGS ${OUT}/results.csv rows REGEX "^mlp,")
list(LENGTH rows count)
if(NOT count EQUAL 60)
  message(FATAL_ERROR "expected 60 result rows (30 variants x worlds 1 and 2), got ${count}")
endif()
