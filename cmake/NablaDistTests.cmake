# Multi-process tests of distributed/: included by NablaTests.cmake after
# the Check suites are registered.
#
# test_dist_collectives runs once alone (a world of one, registered with
# the other suites) and here under nbrun with 2, 3 and 4 ranks, labelled
# multiproc as well as unit. test_dist_failures and test_nbrun drive nbrun
# and tests/dist/dist_scenario themselves; they get the multiproc label too.
# Ports: nbrun picks a free one per run (--master-port 0), so parallel ctest
# runs do not collide; everything stays on 127.0.0.1.

if(NOT TARGET test_dist_collectives)
  return()
endif()

add_executable(dist_scenario ${PROJECT_SOURCE_DIR}/tests/dist/dist_scenario.c)
target_link_libraries(dist_scenario PRIVATE nabla)
set_target_properties(dist_scenario PROPERTIES
  RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests
  LINKER_LANGUAGE ${NABLA_LINKER_LANGUAGE})
target_compile_definitions(dist_scenario PRIVATE ${NABLA_C_DEFINES})
nabla_own_flags(dist_scenario)

# Registers `target` (a Check suite) under nbrun at each of `ranks`, as
# <target>_np<R>, with the CTest timeout `timeout` and NABLA_PG_TIMEOUT
# `pg_timeout` (short, so that a rank left waiting fails in seconds).
# Optional: the tests' name instead of the target's, and one more
# environment entry (the suite run another way).
function(nabla_add_ranked_test target ranks timeout pg_timeout)
  if(NOT TARGET ${target})
    return()
  endif()
  set(_base ${target})
  set(_env "${NABLA_TEST_ENVIRONMENT};NABLA_PG_TIMEOUT=${pg_timeout}")
  if(ARGC GREATER 4)
    set(_base ${ARGV4})
    list(APPEND _env "${ARGV5}")
  endif()
  foreach(_np ${ranks})
    set(_name ${_base}_np${_np})
    add_test(NAME ${_name}
      COMMAND $<TARGET_FILE:nbrun> --nproc-per-node ${_np} --master-port 0 $<TARGET_FILE:${target}>
      WORKING_DIRECTORY ${CMAKE_BINARY_DIR})
    set_tests_properties(${_name} PROPERTIES
      LABELS "unit;multiproc" TIMEOUT ${timeout} SKIP_RETURN_CODE 77
      ENVIRONMENT "${_env}")
    list(APPEND NABLA_TESTS ${_name})
  endforeach()
  set(NABLA_TESTS ${NABLA_TESTS} PARENT_SCOPE)
endfunction()

nabla_add_ranked_test(test_dist_collectives "2;3;4" 120 60)
# DDP and SyncBatchNorm: equivalence with one process.
nabla_add_ranked_test(test_ddp "2;3" 180 60)
# DDP with the optimizer step overlapped per bucket.
nabla_add_ranked_test(test_ddp_bucket_step "2;3" 120 30)
# DDP with ZeRO-1 (optimizer state sharded); 3 ranks make uneven shards.
nabla_add_ranked_test(test_ddp_zero "2;3" 120 30)
# ZeRO-3 / FSDP against DDP (tests/test_fsdp.c); 4 ranks for the memory ratio.
nabla_add_ranked_test(test_fsdp "2;3;4" 120 30)
nabla_add_ranked_test(test_ddp_powersgd "2;3" 120 30)
# The same suite with ZeRO-2 (gradients sharded too), alone and under nbrun.
if(TARGET test_ddp_zero)
  add_test(NAME test_ddp_zero2 COMMAND test_ddp_zero WORKING_DIRECTORY ${CMAKE_BINARY_DIR})
  set_tests_properties(test_ddp_zero2 PROPERTIES LABELS unit TIMEOUT 300 SKIP_RETURN_CODE 77
    ENVIRONMENT "${NABLA_TEST_ENVIRONMENT};NBT_ZERO_STAGE=2")
  list(APPEND NABLA_TESTS test_ddp_zero2)
endif()
nabla_add_ranked_test(test_ddp_zero "2;3" 120 30 test_ddp_zero2 NBT_ZERO_STAGE=2)
# DDP join (uneven inputs): without join, a rank left waiting fails the
# test in seconds, not at the CTest timeout.
nabla_add_ranked_test(test_ddp_join "2;3" 120 10)

foreach(_t test_dist_failures test_dist_mismatch test_nbrun test_train_gpt.py test_train_gpt_zero.py test_train_gpt_zero2.py test_train_gpt_zero3.py test_train_classifier.py test_train_classifier_zero.py test_train_gpt_shard.py test_train_classifier_shard.py test_demo.py)
  if(TEST ${_t})
    set_property(TEST ${_t} APPEND PROPERTY LABELS multiproc)
  endif()
endforeach()

# Two nodes in two network namespaces joined by a veth pair (root only;
# skipped, 77, where a namespace cannot be made): tests/_netns.py. Their
# fixed ports exist only inside namespaces named after the test's pid, so
# parallel runs do not collide.
foreach(_t test_multinode.py test_multinode_cut.py test_elastic.py)
  if(TEST ${_t})
    set_property(TEST ${_t} APPEND PROPERTY LABELS multiproc netns)
    set_tests_properties(${_t} PROPERTIES TIMEOUT 90)
  endif()
endforeach()
