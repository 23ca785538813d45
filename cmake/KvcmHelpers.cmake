# Small helpers so every project target gets the same flags and usage requirements.
#
#   kvcm_library(NAME SRCS ... [HDRS ...] [DEPS ...] [PRIVATE_DEPS ...])
#   kvcm_executable(NAME SRCS ... [DEPS ...])
#   kvcm_test(NAME SRCS ... [DEPS ...] [LABELS unit|integration|fault|fuzz|gpu ...] [TIMEOUT s])
#     A test labelled tsan (its code runs threads) also joins the target kvcm_tsan_tests,
#     which a ThreadSanitizer build (cmake/KvcmSanitizers.cmake) builds instead of `all`.
#   kvcm_benchmark(NAME SRCS ... [DEPS ...])
#
# Include paths are rooted at the repository (#include "common/block/block_ledger.h").

# No -Wnull-dereference: GCC 12 reports FlatBuffers' generated accessors and verifier as
# "potential null pointer dereference" at -O2/-O3, on code that checks its pointers.
set(KVCM_WARNINGS -Wall -Wextra -Wpedantic -Wshadow -Wnon-virtual-dtor -Wold-style-cast
                  -Wcast-align -Wunused -Woverloaded-virtual -Wimplicit-fallthrough)
# Clang checks the lock annotations (ABSL_GUARDED_BY and friends, common/base/mutex.h).
if(CMAKE_CXX_COMPILER_ID MATCHES "Clang")
  list(APPEND KVCM_WARNINGS -Wthread-safety)
endif()
if(KVCM_WERROR)
  list(APPEND KVCM_WARNINGS -Werror)
endif()

function(kvcm_set_flags target)
  target_compile_options(${target} PRIVATE
      $<$<COMPILE_LANGUAGE:CXX>:${KVCM_WARNINGS}>
      $<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall$<SEMICOLON>-Werror=all-warnings>)
endfunction()

function(kvcm_library name)
  cmake_parse_arguments(ARG "" "" "SRCS;HDRS;DEPS;PRIVATE_DEPS" ${ARGN})
  if(ARG_SRCS)
    add_library(${name} STATIC ${ARG_SRCS} ${ARG_HDRS})
    target_include_directories(${name} PUBLIC ${PROJECT_SOURCE_DIR})
    target_link_libraries(${name} PUBLIC ${ARG_DEPS} PRIVATE ${ARG_PRIVATE_DEPS})
    kvcm_set_flags(${name})
  else()
    add_library(${name} INTERFACE ${ARG_HDRS})
    target_include_directories(${name} INTERFACE ${PROJECT_SOURCE_DIR})
    target_link_libraries(${name} INTERFACE ${ARG_DEPS})
  endif()
  add_library(kvcm::${name} ALIAS ${name})
endfunction()

function(kvcm_executable name)
  cmake_parse_arguments(ARG "" "OUTPUT_NAME" "SRCS;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SRCS})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS})
  kvcm_set_flags(${name})
  if(ARG_OUTPUT_NAME)
    set_target_properties(${name} PROPERTIES OUTPUT_NAME ${ARG_OUTPUT_NAME})
  endif()
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bin)
endfunction()

include(GoogleTest OPTIONAL)
if(NOT TARGET kvcm_tsan_tests)
  add_custom_target(kvcm_tsan_tests)
endif()
function(kvcm_test name)
  cmake_parse_arguments(ARG "" "TIMEOUT" "SRCS;DEPS;LABELS" ${ARGN})
  if(NOT ARG_LABELS)
    set(ARG_LABELS unit)
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()
  add_executable(${name} ${ARG_SRCS})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} GTest::gtest GTest::gmock GTest::gtest_main)
  kvcm_set_flags(${name})
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/tests)
  gtest_discover_tests(${name}
      PROPERTIES TIMEOUT ${ARG_TIMEOUT}
      DISCOVERY_TIMEOUT 60)
  # The labels, set by a CTest include file read after the discovered tests: through
  # gtest_discover_tests (CMake 3.25) a list of two labels reaches set_tests_properties
  # unquoted, and becomes one label and a stray property.
  set(KVCM_DISCOVERED "${CMAKE_CURRENT_BINARY_DIR}/${name}[1]_tests.cmake")
  set(KVCM_LABELS "${ARG_LABELS}")
  set(labels_file "${CMAKE_CURRENT_BINARY_DIR}/${name}_labels.cmake")
  file(CONFIGURE OUTPUT "${labels_file}" CONTENT [==[
if(EXISTS "@KVCM_DISCOVERED@")
  file(STRINGS "@KVCM_DISCOVERED@" kvcm_added REGEX "^add_test\\(")
  foreach(kvcm_line IN LISTS kvcm_added)
    string(REGEX REPLACE "^add_test\\(\\[=\\[(.*)\\]=\\] .*$" "\\1" kvcm_test "${kvcm_line}")
    set_tests_properties("${kvcm_test}" PROPERTIES LABELS "@KVCM_LABELS@")
  endforeach()
endif()
]==] @ONLY)
  set_property(DIRECTORY APPEND PROPERTY TEST_INCLUDE_FILES "${labels_file}")
  if("tsan" IN_LIST ARG_LABELS)
    add_dependencies(kvcm_tsan_tests ${name})
  endif()
endfunction()

function(kvcm_benchmark name)
  cmake_parse_arguments(ARG "" "" "SRCS;DEPS" ${ARGN})
  add_executable(${name} ${ARG_SRCS})
  target_link_libraries(${name} PRIVATE ${ARG_DEPS} benchmark::benchmark)
  kvcm_set_flags(${name})
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${PROJECT_BINARY_DIR}/bench)
endfunction()
