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

# Applies the project's warnings and shared precompiled header to a target.
function(accelerate_target_defaults target)
  target_compile_options(${target} PRIVATE ${ACCELERATE_WARNINGS})
  if(ACCELERATE_PCH AND NOT target STREQUAL "accelerate")
    target_precompile_headers(${target} REUSE_FROM accelerate)
  endif()
endfunction()
