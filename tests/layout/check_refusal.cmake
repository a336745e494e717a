# The include rule's check can fail: over tests/layout/broken_tree, which breaks each rule once,
# check_layout.cmake must fail and name every problem.
cmake_minimum_required(VERSION 3.25)
execute_process(COMMAND ${CMAKE_COMMAND} -DSOURCE_DIR=${CMAKE_CURRENT_LIST_DIR}/broken_tree
                        -P ${CMAKE_CURRENT_LIST_DIR}/check_layout.cmake
                RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(text "${out}${err}")
if(code EQUAL 0)
  message(FATAL_ERROR "check_layout.cmake accepted a tree that breaks the include rule:\n${text}")
endif()
set(expected
    "src/detail/low.cpp includes \"fsdp/engine.h\": detail/ may include only detail/"
    "src/fsdp/engine.cpp includes \"launch/supervisor.h\": nothing outside launch/ includes it"
    "src/fsdp/engine.cpp includes \"detail/missing.h\", which is not a file of src/"
    "launch/supervisor.h is compiled into the torch-free launcher"
    "src/extra/ has no include rule"
    "src/extra/ is not on the map"
    "src/detail/low.cpp includes \"accelerate/engine.h\" (a public header of fsdp/): detail/ may include only detail/"
    "include/accelerate/utils/tensor_tree.h includes \"accelerate/engine.h\" (a public header of fsdp/): detail/ may include only detail/"
    "include/accelerate/orphan.h lives in no layer"
    "include/accelerate/orphan.h does not start with its purpose"
    "tests/layout/check_layout.cmake: layer_of_hooks.cpp names no file of src/"
    "src/fsdp/engine.h declares shard(), which none of its files defines (fsdp/engine.cpp)")
foreach(line IN LISTS expected)
  string(FIND "${text}" "${line}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "check_layout.cmake did not say: ${line}\nIt said:\n${text}")
  endif()
endforeach()
message(STATUS "check_layout.cmake refused the broken tree, naming each of its problems")
