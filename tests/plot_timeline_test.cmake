# Runs scripts/plot-timeline on a two-rank trace with a known bubble: it must write a PNG and
# print the step's idle share (rank 0 computes 0-10 and 30-40 ms, rank 1 10-30 ms: window 40 ms,
# rank 0 idle 50%, rank 1 idle 50%); a trace without spans must fail naming the file.
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
file(WRITE ${WORK}/t.json
"{\"traceEvents\": [
{\"ph\": \"X\", \"pid\": 0, \"tid\": 0, \"cat\": \"step\", \"name\": \"step 1\", \"ts\": 1000000, \"dur\": 41000},
{\"ph\": \"X\", \"pid\": 1, \"tid\": 0, \"cat\": \"step\", \"name\": \"step 1\", \"ts\": 1000000, \"dur\": 41000},
{\"ph\": \"X\", \"pid\": 0, \"tid\": 0, \"cat\": \"forward\", \"name\": \"F0\", \"ts\": 1000000, \"dur\": 10000},
{\"ph\": \"X\", \"pid\": 1, \"tid\": 0, \"cat\": \"forward\", \"name\": \"F0\", \"ts\": 1010000, \"dur\": 5000},
{\"ph\": \"X\", \"pid\": 1, \"tid\": 0, \"cat\": \"backward\", \"name\": \"B0\", \"ts\": 1015000, \"dur\": 15000},
{\"ph\": \"X\", \"pid\": 0, \"tid\": 0, \"cat\": \"recv\", \"name\": \"gradient 0\", \"ts\": 1010000, \"dur\": 20000},
{\"ph\": \"X\", \"pid\": 0, \"tid\": 0, \"cat\": \"backward\", \"name\": \"B0\", \"ts\": 1030000, \"dur\": 10000}
]}
")
execute_process(COMMAND ${SCRIPT} ${WORK}/t.json ${WORK}/t.json --labels a,b -o ${WORK}/t.png
                RESULT_VARIABLE rc OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "plot-timeline failed (${rc}): ${err}")
endif()
if(NOT out MATCHES "a: step 1: 40.00 ms, bubble 50.0% \\(rank 0 50.0%, rank 1 50.0%\\)")
  message(FATAL_ERROR "plot-timeline printed the wrong bubble: ${out}")
endif()
file(READ ${WORK}/t.png magic LIMIT 4 HEX)
if(NOT magic STREQUAL "89504e47")
  message(FATAL_ERROR "plot-timeline did not write a PNG (magic ${magic})")
endif()
file(WRITE ${WORK}/empty.json "{\"traceEvents\": []}")
execute_process(COMMAND ${SCRIPT} ${WORK}/empty.json RESULT_VARIABLE rc ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "empty.json has no spans")
  message(FATAL_ERROR "a trace without spans was not reported: ${rc} ${err}")
endif()
message(STATUS "PlotTimeline: 3 checks passed")
