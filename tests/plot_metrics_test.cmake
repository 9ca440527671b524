# Runs scripts/plot-metrics on a small metrics file and checks it wrote a PNG; a file that is not
# JSON must fail with the file and line named.
file(REMOVE_RECURSE ${WORK})
file(MAKE_DIRECTORY ${WORK})
file(WRITE ${WORK}/m.jsonl
"{\"event\":\"step\",\"step\":10,\"loss\":2.1,\"lr\":0.01}
{\"event\":\"step\",\"step\":20,\"loss\":1.5,\"lr\":0.02}
{\"event\":\"eval\",\"step\":20,\"val_accuracy\":0.71}
{\"event\":\"summary\",\"strategy\":\"ddp\",\"world_size\":2,\"global_batch\":128,\"samples_per_s\":3000}
")
execute_process(COMMAND ${SCRIPT} ${WORK}/m.jsonl -o ${WORK}/m.png RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "plot-metrics failed (${rc}): ${err}")
endif()
file(READ ${WORK}/m.png magic LIMIT 4 HEX)
if(NOT magic STREQUAL "89504e47")
  message(FATAL_ERROR "plot-metrics did not write a PNG (magic ${magic})")
endif()
file(WRITE ${WORK}/bad.jsonl "{\"event\":\"step\",\"step\":1,\"loss\":1}\nnot json\n")
execute_process(COMMAND ${SCRIPT} ${WORK}/bad.jsonl RESULT_VARIABLE rc ERROR_VARIABLE err)
if(rc EQUAL 0 OR NOT err MATCHES "bad.jsonl:2")
  message(FATAL_ERROR "a corrupt metrics file was not reported with its line: ${rc} ${err}")
endif()
# A federated run's rounds.
file(WRITE ${WORK}/fl.jsonl
"{\"event\":\"round\",\"round\":1,\"applied\":1,\"train_loss\":1.2,\"test_loss\":1.0,\"test_accuracy\":0.6,\"uplink_bytes\":1000}
{\"event\":\"round\",\"round\":2,\"applied\":1,\"train_loss\":0.9,\"test_loss\":0.8,\"test_accuracy\":0.7,\"uplink_bytes\":1000}
")
execute_process(COMMAND ${SCRIPT} ${WORK}/fl.jsonl -o ${WORK}/fl.png RESULT_VARIABLE rc
                ERROR_VARIABLE err)
file(READ ${WORK}/fl.png magic LIMIT 4 HEX)
if(NOT rc EQUAL 0 OR NOT magic STREQUAL "89504e47")
  message(FATAL_ERROR "plot-metrics did not draw a federated run (${rc}): ${err}")
endif()
# A language model's run, resumed into the same file: its validation loss and perplexity, not
# an accuracy, and a title over the whole run.
file(WRITE ${WORK}/lm.jsonl
"{\"event\":\"step\",\"step\":10,\"loss\":4.1,\"lr\":0.01}
{\"event\":\"eval\",\"step\":10,\"val_loss\":3.9,\"val_accuracy\":0.2,\"val_bits_per_token\":5.6}
{\"event\":\"summary\",\"strategy\":\"ddp\",\"world_size\":2,\"global_batch\":32,\"start_step\":0}
{\"event\":\"step\",\"step\":20,\"loss\":3.1,\"lr\":0.01}
{\"event\":\"eval\",\"step\":20,\"val_loss\":3.0,\"val_accuracy\":0.3,\"val_bits_per_token\":4.3}
{\"event\":\"summary\",\"strategy\":\"ddp\",\"world_size\":2,\"global_batch\":32,\"start_step\":10}
")
execute_process(COMMAND ${SCRIPT} ${WORK}/lm.jsonl -o ${WORK}/lm.png RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "validation loss \\(nats/token\\)" OR
   NOT out MATCHES "steps 10-20 \\(resumed from step 10\\)")
  message(FATAL_ERROR "a language model's resumed run was not drawn as one (${rc}): ${out} ${err}")
endif()
# A mixture of experts: a third panel of each layer's max / mean expert load.
file(WRITE ${WORK}/moe.jsonl
"{\"event\":\"step\",\"step\":1,\"loss\":4.1,\"lr\":0.01,\"moe_imbalance\":2.5,\"moe_imbalance.blocks.1\":2.5,\"moe_imbalance.blocks.2\":1.9,\"moe_dropped\":0.1}
{\"event\":\"step\",\"step\":2,\"loss\":3.9,\"lr\":0.01,\"moe_imbalance\":1.4,\"moe_imbalance.blocks.1\":1.4,\"moe_imbalance.blocks.2\":1.2,\"moe_dropped\":0.02}
{\"event\":\"eval\",\"step\":2,\"val_loss\":3.8,\"val_accuracy\":0.2,\"val_bits_per_token\":5.5}
")
execute_process(COMMAND ${SCRIPT} ${WORK}/moe.jsonl -o ${WORK}/moe.png RESULT_VARIABLE rc
                OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT rc EQUAL 0 OR NOT out MATCHES "expert load max / mean of 2 layers")
  message(FATAL_ERROR "a mixture of experts' loads were not drawn (${rc}): ${out} ${err}")
endif()
message(STATUS "PlotMetrics: 5 checks passed")
