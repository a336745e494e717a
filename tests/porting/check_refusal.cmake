# The name index's check can fail: over tests/porting/broken_tree, whose index misses a free
# function, a member function of `Accelerator` and a type of a second header, lists one name twice,
# one under the wrong header and one that no header declares, check_names.cmake must fail and name
# each; and the declarations that are no public name (in comments, strings, `detail` namespaces,
# private parts, specialisations) must not be among the names it reads.
cmake_minimum_required(VERSION 3.25)
set(tree "${CMAKE_CURRENT_LIST_DIR}/broken_tree")
execute_process(COMMAND ${CMAKE_COMMAND} -DSOURCE_DIR=${tree} -P ${CMAKE_CURRENT_LIST_DIR}/check_names.cmake
                RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE err)
set(text "${out}${err}")
if(code EQUAL 0)
  message(FATAL_ERROR "check_names.cmake accepted an index that disagrees with its headers:\n${text}")
endif()
set(expected
    "`accelerate::missing_function`, declared in include/accelerate/state.h, is not in docs/porting.md's index"
    "`accelerate::Accelerator::missing_member`, declared in include/accelerate/state.h, is not in docs/porting.md's index"
    "`accelerate::utils_like::MissingType`, declared in include/accelerate/utils/extra.h, is not in docs/porting.md's index"
    "docs/porting.md lists `accelerate::Accelerator::prepare` twice"
    "docs/porting.md lists `accelerate::utils_like::Indexed` under accelerate/state.h, but accelerate/utils/extra.h declares it"
    "docs/porting.md lists `accelerate::removed_long_ago` (under accelerate/state.h), which no public header declares")
foreach(line IN LISTS expected)
  string(FIND "${text}" "${line}" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "check_names.cmake did not say: ${line}\nIt said:\n${text}")
  endif()
endforeach()
string(REGEX MATCHALL "\n    [^\n]*" problems "${text}")
list(LENGTH problems count)
list(LENGTH expected expected_count)
if(NOT count EQUAL expected_count)
  message(FATAL_ERROR "check_names.cmake named ${count} problems where the tree has ${expected_count}:\n${text}")
endif()

# What it reads as the tree's public names: exactly these.
execute_process(COMMAND ${CMAKE_COMMAND} -DSOURCE_DIR=${tree} -DLIST=ON -P ${CMAKE_CURRENT_LIST_DIR}/check_names.cmake
                RESULT_VARIABLE code OUTPUT_VARIABLE out ERROR_VARIABLE listed)
set(expected_names
    "state.h accelerate::kText" "state.h accelerate::kQuote" "state.h accelerate::Mode" "state.h accelerate::ModeList"
    "state.h accelerate::Named" "state.h accelerate::Options" "state.h accelerate::overloaded"
    "state.h accelerate::with_lambda" "state.h accelerate::kLambda" "state.h accelerate::Accelerator"
    "state.h accelerate::Accelerator::step" "state.h accelerate::Accelerator::prepare"
    "state.h accelerate::Accelerator::missing_member" "state.h accelerate::missing_function"
    "utils/extra.h accelerate::utils_like::Indexed" "utils/extra.h accelerate::utils_like::MissingType"
    "state.h accelerate::TensorTree")
string(STRIP "${listed}" listed)
string(REPLACE "\n" ";" listed "${listed}")
if(NOT code EQUAL 0 OR NOT listed STREQUAL "${expected_names}")
  list(JOIN listed "\n  " got)
  list(JOIN expected_names "\n  " want)
  message(FATAL_ERROR "check_names.cmake -DLIST=ON read the broken tree's names as:\n  ${got}\nwhere they are:\n  ${want}")
endif()
message(STATUS "check_names.cmake refused the broken index, naming each of its problems")
