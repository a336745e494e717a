# Compiles the example of every public header's banner comment, so that an example that no longer
# compiles fails the test suite. Run as a test:
#   cmake -DSOURCE_DIR=<project> -DWORK_DIR=<scratch> -DCXX=<compiler> -DINCLUDES=<dir|dir|...> -P check.cmake
# Each banner's example (the lines "//   ..." after "// Example" and before "#pragma once") is
# written to WORK_DIR/<header path>.inc with #line directives, so compiler errors point at the
# header's own lines; tests/header_examples/examples.cpp includes each one in a context that
# declares the names the example takes for granted (a model, a loader, ...).
cmake_minimum_required(VERSION 3.20)

file(GLOB_RECURSE headers RELATIVE ${SOURCE_DIR}/include ${SOURCE_DIR}/include/accelerate/*.h)
file(READ ${SOURCE_DIR}/tests/header_examples/examples.cpp context)
file(REMOVE_RECURSE ${WORK_DIR})
set(count 0)
foreach(header IN LISTS headers)
  if(header MATCHES "^accelerate/commands/")
    continue()  # their examples are shell commands, run by the cli tests
  endif()
  file(STRINGS ${SOURCE_DIR}/include/${header} lines)
  set(in_example FALSE)
  set(number 0)
  set(snippet "")
  foreach(line IN LISTS lines)
    math(EXPR number "${number} + 1")
    if(line MATCHES "^#pragma once")
      break()
    endif()
    if(line MATCHES "^// Example")
      set(in_example TRUE)
    elseif(in_example AND line MATCHES "^//   (.*)$")
      string(APPEND snippet "#line ${number} \"${SOURCE_DIR}/include/${header}\"\n${CMAKE_MATCH_1}\n")
    elseif(in_example)
      set(in_example FALSE)
    endif()
  endforeach()
  if(snippet STREQUAL "")
    continue()
  endif()
  string(FIND "${context}" "#include \"${header}.inc\"" at)
  if(at EQUAL -1)
    message(FATAL_ERROR "include/${header} has a banner example, but tests/header_examples/examples.cpp does not "
                        "include \"${header}.inc\": give it a context there")
  endif()
  file(WRITE ${WORK_DIR}/${header}.inc "${snippet}")
  math(EXPR count "${count} + 1")
endforeach()

set(flags -std=c++20 -fsyntax-only -Wall -Wextra -Werror -Wno-unused-variable -Wno-unused-but-set-variable
          -Wno-unused-parameter -I${WORK_DIR} -I${SOURCE_DIR}/include)
string(REPLACE "|" ";" include_dirs "${INCLUDES}")
foreach(dir IN LISTS include_dirs)
  # LibTorch's folders are system headers (their warnings are not the examples'); /usr/include
  # already is one, and naming it again would break the C++ library's #include_next.
  if(NOT dir STREQUAL "/usr/include")
    list(APPEND flags -isystem ${dir})
  endif()
endforeach()
execute_process(COMMAND ${CXX} ${flags} ${SOURCE_DIR}/tests/header_examples/examples.cpp
                RESULT_VARIABLE result OUTPUT_VARIABLE out ERROR_VARIABLE err)
if(NOT result EQUAL 0)
  message(FATAL_ERROR "a header's banner example does not compile:\n${out}${err}")
endif()
message(STATUS "header examples: ${count} banner examples compile")
