# Fuzz targets: one function, LLVMFuzzerTestOneInput, per inbound decoder
# (tests/support/fuzz_target.h), declared next to the tests of what it decodes with
#
#   kvcm_fuzz_target(NAME SRCS ... [DEPS ...] CORPUS dir [DICT file] [REGRESSIONS dir]
#                    [ITERATIONS n] [MAX_LEN bytes] [TIMEOUT s])
#
# which makes
#   - NAME_seed_test (label fuzz), in every build: the seed corpus in CORPUS (committed
#     files, each a valid input), ITERATIONS (default 20000) seeded mutations of it, and the
#     inputs in REGRESSIONS (each one that broke the target once, kept as found), run
#     through the target by tests/support/fuzz_driver.cc;
#   - with KVCM_FUZZERS=ON (clang only): NAME_fuzzer in BUILD_DIR/fuzz/, the libFuzzer
#     binary, and a line "NAME CORPUS DICT MAX_LEN" (DICT "-" for none) in BUILD_DIR/fuzz/targets.tsv for
#     scripts/fuzz.sh. Target `kvcm_fuzzers` builds them all.
#
# KVCM_FUZZERS=ON instruments the whole build for coverage (-fsanitize=fuzzer-no-link) and
# runs it under AddressSanitizer and UndefinedBehaviorSanitizer (undefined behaviour aborts),
# so the libraries a target reaches are guided and checked, not only the target's own file.
# It is for a build directory of its own (scripts/fuzz.sh: BUILD_DIR-fuzz) that builds only
# `kvcm_fuzzers`.

option(KVCM_FUZZERS "Build the libFuzzer binaries of the fuzz targets (clang)" OFF)

if(KVCM_FUZZERS)
  if(NOT CMAKE_CXX_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "KVCM_FUZZERS=ON needs clang (-DCMAKE_CXX_COMPILER=clang++-14 "
                        "-DCMAKE_C_COMPILER=clang-14), not ${CMAKE_CXX_COMPILER_ID}")
  endif()
  set(KVCM_FUZZ_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=undefined
                      -fno-omit-frame-pointer)
  add_compile_options(-fsanitize=fuzzer-no-link ${KVCM_FUZZ_FLAGS})
  add_link_options(-fsanitize=address,undefined)
  add_custom_target(kvcm_fuzzers)
  set(KVCM_FUZZ_MANIFEST "${PROJECT_BINARY_DIR}/fuzz/targets.tsv")
  file(WRITE "${KVCM_FUZZ_MANIFEST}" "")
endif()

function(kvcm_fuzz_target name)
  cmake_parse_arguments(ARG "" "CORPUS;DICT;REGRESSIONS;ITERATIONS;MAX_LEN;TIMEOUT" "SRCS;DEPS"
                        ${ARGN})
  if(NOT ARG_CORPUS)
    message(FATAL_ERROR "kvcm_fuzz_target(${name}): CORPUS is required")
  endif()
  cmake_path(ABSOLUTE_PATH ARG_CORPUS BASE_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR})
  if(ARG_DICT)
    cmake_path(ABSOLUTE_PATH ARG_DICT BASE_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR})
  endif()
  if(ARG_REGRESSIONS)
    cmake_path(ABSOLUTE_PATH ARG_REGRESSIONS BASE_DIRECTORY ${CMAKE_CURRENT_SOURCE_DIR})
  endif()
  if(NOT ARG_ITERATIONS)
    set(ARG_ITERATIONS 20000)
  endif()
  if(NOT ARG_MAX_LEN)
    set(ARG_MAX_LEN 4096)
  endif()
  if(NOT ARG_TIMEOUT)
    set(ARG_TIMEOUT 300)
  endif()

  # The gtest suite is named after the target (tokenizer_json: TokenizerJsonFuzzSeedTest),
  # so that ctest tells the targets' tests apart.
  string(REPLACE "_" ";" pieces "${name}")
  set(suite "")
  foreach(piece IN LISTS pieces)
    string(SUBSTRING "${piece}" 0 1 first)
    string(TOUPPER "${first}" first)
    string(SUBSTRING "${piece}" 1 -1 rest)
    string(APPEND suite "${first}${rest}")
  endforeach()
  string(APPEND suite "FuzzSeedTest")

  kvcm_test(${name}_seed_test
    SRCS ${ARG_SRCS} ${PROJECT_SOURCE_DIR}/tests/support/fuzz_driver.cc
    DEPS ${ARG_DEPS} kvcm_fuzz_support
    LABELS fuzz
    TIMEOUT ${ARG_TIMEOUT})
  target_compile_definitions(${name}_seed_test PRIVATE
    KVCM_FUZZ_NAME="${name}"
    KVCM_FUZZ_SUITE=${suite}
    KVCM_FUZZ_CORPUS_DIR="${ARG_CORPUS}"
    KVCM_FUZZ_DICT="${ARG_DICT}"
    KVCM_FUZZ_REGRESSIONS_DIR="${ARG_REGRESSIONS}"
    KVCM_FUZZ_ITERATIONS=${ARG_ITERATIONS}
    KVCM_FUZZ_MAX_LEN=${ARG_MAX_LEN})

  if(KVCM_FUZZERS)
    add_executable(${name}_fuzzer ${ARG_SRCS})
    target_link_libraries(${name}_fuzzer PRIVATE ${ARG_DEPS} kvcm_fuzz_support)
    target_link_options(${name}_fuzzer PRIVATE -fsanitize=fuzzer)
    kvcm_set_flags(${name}_fuzzer)
    set_target_properties(${name}_fuzzer PROPERTIES RUNTIME_OUTPUT_DIRECTORY
                          ${PROJECT_BINARY_DIR}/fuzz)
    add_dependencies(kvcm_fuzzers ${name}_fuzzer)
    if(ARG_DICT)
      set(dict "${ARG_DICT}")
    else()
      set(dict "-")
    endif()
    file(APPEND "${KVCM_FUZZ_MANIFEST}" "${name}\t${ARG_CORPUS}\t${dict}\t${ARG_MAX_LEN}\n")
  endif()
endfunction()
