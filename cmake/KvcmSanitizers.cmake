# Sanitizer builds (docs/RELIABILITY.md, "Sanitizers"): KVCM_SANITIZE is a comma-separated
# list handed to -fsanitize=, or empty for none.
#
#   -DKVCM_SANITIZE=address,undefined   # ASan + UBSan: the whole suite (scripts/test.sh)
#   -DKVCM_SANITIZE=thread              # TSan: the tests labelled tsan
#
# ON is taken as address,undefined and OFF as none (the option was a boolean before).
# Every C and C++ translation unit of the project gets the flags; CUDA sources do not (nvcc
# has no host sanitizers; configure sanitizer builds with -DKVCM_CUDA=OFF). UBSan does not
# recover (-fno-sanitize-recover=all), so a finding fails the test that hit it. The runtime
# options (detect_leaks, halt_on_error, the suppressions in tests/sanitizers/) are set for
# the tests by scripts/test.sh, since they must reach the processes the tests start too.
#
# Sets KVCM_SANITIZE_LIST (the sanitizers, as a CMake list) for kvcm_test's labels.
set(KVCM_SANITIZE "" CACHE STRING
    "Sanitizers for -fsanitize= (address,undefined | thread), empty for none")
if(KVCM_SANITIZE STREQUAL "ON")
  set(KVCM_SANITIZE "address,undefined")
elseif(NOT KVCM_SANITIZE OR KVCM_SANITIZE STREQUAL "OFF")
  set(KVCM_SANITIZE "")
endif()
string(REPLACE "," ";" KVCM_SANITIZE_LIST "${KVCM_SANITIZE}")

if(KVCM_SANITIZE_LIST)
  foreach(sanitizer IN LISTS KVCM_SANITIZE_LIST)
    if(NOT sanitizer MATCHES "^(address|undefined|thread|leak)$")
      message(FATAL_ERROR "KVCM_SANITIZE: unknown sanitizer '${sanitizer}' "
                          "(known: address, undefined, thread, leak)")
    endif()
  endforeach()
  if("thread" IN_LIST KVCM_SANITIZE_LIST AND "address" IN_LIST KVCM_SANITIZE_LIST)
    message(FATAL_ERROR "KVCM_SANITIZE: thread and address cannot be combined; "
                        "build them in two build directories")
  endif()
  if(KVCM_CUDA_ENABLED)
    message(WARNING "KVCM_SANITIZE with CUDA: the .cu sources are built without sanitizers; "
                    "configure with -DKVCM_CUDA=OFF for a sanitizer build")
  endif()
  set(kvcm_sanitize_flags -fsanitize=${KVCM_SANITIZE} -fno-omit-frame-pointer)
  if("undefined" IN_LIST KVCM_SANITIZE_LIST)
    list(APPEND kvcm_sanitize_flags -fno-sanitize-recover=all)
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${kvcm_sanitize_flags}>")
  add_link_options(-fsanitize=${KVCM_SANITIZE})
endif()
