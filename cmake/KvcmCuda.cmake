# Decides whether CUDA code is built (KVCM_CUDA = AUTO | ON | OFF) and enables the language.
# Sets KVCM_CUDA_ENABLED. Targets sm_90 (H100/H200) as real code plus compute_90 PTX so
# newer devices can JIT it; override with -DCMAKE_CUDA_ARCHITECTURES.
set(KVCM_CUDA_ENABLED OFF)
if(NOT KVCM_CUDA STREQUAL "OFF")
  if(NOT CMAKE_CUDA_COMPILER)
    find_program(KVCM_NVCC nvcc HINTS ENV CUDA_HOME ENV CUDA_PATH
                 PATHS /usr/local/cuda/bin /usr/lib/cuda/bin PATH_SUFFIXES bin)
    if(KVCM_NVCC)
      set(CMAKE_CUDA_COMPILER "${KVCM_NVCC}" CACHE FILEPATH "CUDA compiler")
    endif()
  endif()
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES "90-real;90-virtual")
    endif()
    # CMake 3.25 has no C++20 flag table for nvcc; device code is C++17.
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_EXTENSIONS OFF)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    enable_language(CUDA)
    find_package(CUDAToolkit REQUIRED)
    set(KVCM_CUDA_ENABLED ON)
  elseif(KVCM_CUDA STREQUAL "ON")
    message(FATAL_ERROR "KVCM_CUDA=ON but nvcc was not found (looked on PATH and in "
                        "/usr/local/cuda/bin); set CMAKE_CUDA_COMPILER")
  else()
    message(STATUS "kvcm: nvcc not found, building without CUDA")
  endif()
endif()
