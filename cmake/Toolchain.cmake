# Compiler settings shared by every target of the project: ccache, warnings, sanitizers.

find_program(ACCELERATE_CCACHE ccache)
if(ACCELERATE_CCACHE AND NOT CMAKE_CXX_COMPILER_LAUNCHER)
  # Precompiled headers need these relaxations for ccache to hit. Paths under the source tree
  # are hashed relative to it. (A clone in another folder still misses: the precompiled header
  # it builds differs from byte to byte, and every object's hash includes it.)
  set(CMAKE_CXX_COMPILER_LAUNCHER
      ${CMAKE_COMMAND} -E env
      CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
      CCACHE_BASEDIR=${PROJECT_SOURCE_DIR} CCACHE_NOHASHDIR=1
      ${ACCELERATE_CCACHE})
endif()

# Every object is position independent so that one precompiled header serves the library,
# the tests and the programs alike (GCC rejects a PCH built with different PIC flags).
add_compile_options(-fPIC)

set(ACCELERATE_WARNINGS -Wall -Wextra -Wno-unused-parameter)
if(ACCELERATE_WERROR)
  list(APPEND ACCELERATE_WARNINGS -Werror)
endif()

if(ACCELERATE_SANITIZE)
  add_compile_options(-fsanitize=address,undefined -fno-omit-frame-pointer -fno-sanitize-recover=undefined)
  add_link_options(-fsanitize=address,undefined)
endif()
if(ACCELERATE_SANITIZE_THREAD)
  if(ACCELERATE_SANITIZE)
    message(FATAL_ERROR "ThreadSanitizer and AddressSanitizer cannot be combined; use one preset each")
  endif()
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer)
  add_link_options(-fsanitize=thread)
endif()

# Note [Unity builds]
# Loading the precompiled LibTorch header costs each translation unit about ten seconds of CPU
# before it compiles a line of its own (the header is ~650 MB), and every unit then generates the
# same inline LibTorch code again. With ACCELERATE_UNITY_BUILD, each target compiles its sources
# in batches of ACCELERATE_UNITY_BATCH files, one translation unit per batch: a build from an
# empty compiler cache takes about half as long. The price is that a change to one file
# recompiles its batch, and that each file's file-local names must not clash with another's
# (they share the batch's anonymous namespace); set ACCELERATE_UNITY_BUILD=OFF to iterate on one
# file.
option(ACCELERATE_UNITY_BUILD "Compile each target's sources in batches (unity build)" ON)
set(ACCELERATE_UNITY_BATCH 8 CACHE STRING "Source files per unity batch")
if(ACCELERATE_UNITY_BUILD)
  # A file's own types in its anonymous namespace are members of its classes; GCC warns about
  # that only in included files, which every source of a batch is.
  list(APPEND ACCELERATE_WARNINGS -Wno-subobject-linkage)
endif()

# Compiles a target's sources in unity batches when ACCELERATE_UNITY_BUILD is on.
function(accelerate_unity_batches target)
  if(ACCELERATE_UNITY_BUILD)
    set_target_properties(${target} PROPERTIES UNITY_BUILD ON UNITY_BUILD_BATCH_SIZE ${ACCELERATE_UNITY_BATCH})
  endif()
endfunction()

# Applies the project's warnings, shared precompiled header and unity batches to a target.
function(accelerate_target_defaults target)
  target_compile_options(${target} PRIVATE ${ACCELERATE_WARNINGS})
  accelerate_unity_batches(${target})
  if(ACCELERATE_PCH AND NOT target STREQUAL "accelerate")
    target_precompile_headers(${target} REUSE_FROM accelerate)
  endif()
endfunction()
