# Finds what the library links: OpenBLAS and threads always; CUDA (with
# cuBLAS, cuBLASLt, cuDNN, NCCL) and Gloo when asked for or, with AUTO, when
# present. Results:
#   NABLA_HAVE_CUDA, NABLA_HAVE_GLOO        0 or 1
#   NABLA_OPENBLAS_LIBRARIES                libraries to link (full paths)
#   NABLA_DNNL_LIBRARIES                    oneDNN (full path), always required
#   NABLA_CRYPTO_LIBRARIES                  OpenSSL's libcrypto (full path), always required
#   NABLA_BACKEND_LIBRARIES                 Gloo library (full path)
#   NABLA_CUDA_LIBRARIES                    CUDA libraries (full paths), for the CUDA plugin only
#   NABLA_PRIVATE_INCLUDE_DIRS              headers the library's sources need
#   NABLA_CUDNN_FRONTEND_INCLUDE_DIR        cudnn-frontend's headers (CUDA builds; empty: none)
#   NABLA_*_SUMMARY                         one line each for the summary
#
# Libraries are linked by full path, not through imported targets, so that
# the installed package needs nothing but Threads to describe its links.

find_package(PkgConfig QUIET)
set(THREADS_PREFER_PTHREAD_FLAG ON)
find_package(Threads REQUIRED)

set(NABLA_BACKEND_LIBRARIES "")
set(NABLA_CUDA_LIBRARIES "")
set(NABLA_PRIVATE_INCLUDE_DIRS "")

# AUTO, ON or OFF from whatever the user wrote (TRUE, yes, 0, ...).
function(nabla_tristate var)
  string(TOUPPER "${${var}}" _v)
  if(_v STREQUAL "AUTO" OR _v STREQUAL "")
    set(_mode AUTO)
  elseif(${var})
    set(_mode ON)
  else()
    set(_mode OFF)
  endif()
  set(${var}_MODE ${_mode} PARENT_SCOPE)
endfunction()

# NABLA_<name>_INCLUDE_DIR (the directory of `header`; ARGN: find_path's
# further options) and NABLA_<name>_LIBRARY (lib`library`) of a dependency
# nabla cannot do without, the directory added to the private includes; or
# a stop saying what is missing (`what`) and how to install it (Debian's
# `package`, or `install` on CMAKE_PREFIX_PATH).
macro(nabla_find_required name header library package install what)
  find_path(NABLA_${name}_INCLUDE_DIR ${header} ${ARGN})
  find_library(NABLA_${name}_LIBRARY NAMES ${library})
  if(NOT NABLA_${name}_INCLUDE_DIR OR NOT NABLA_${name}_LIBRARY)
    message(FATAL_ERROR "${what}.\n"
      "On Debian or Ubuntu install the package ${package} (`make deps` does it), "
      "or point CMAKE_PREFIX_PATH at ${install}.")
  endif()
  list(APPEND NABLA_PRIVATE_INCLUDE_DIRS ${NABLA_${name}_INCLUDE_DIR})
endmacro()

# A piece of the optional dependency NABLA_<name> (AUTO, ON or OFF) is
# missing: with ON the configuration stops, naming it and `advice` (how to
# get it); with AUTO the dependency is turned off (`ok` FALSE) and the
# summary says why.
macro(nabla_missing name ok reason advice)
  if(NABLA_${name}_MODE STREQUAL "ON")
    message(FATAL_ERROR "NABLA_${name}=ON, but ${reason}.\n"
      "${advice} or configure with -DNABLA_${name}=OFF.")
  endif()
  set(NABLA_${name}_SUMMARY "off (AUTO: ${reason})")
  set(${ok} FALSE)
endmacro()

# "MAJOR.MINOR.PATCH" from three #defines in a header.
function(nabla_header_version out header major minor patch)
  set(_version "")
  if(EXISTS "${header}")
    file(STRINGS "${header}" _lines REGEX "#define (${major}|${minor}|${patch}) ")
    foreach(_n ${major} ${minor} ${patch})
      string(REGEX MATCH "#define ${_n} +([0-9]+)" _m "${_lines}")
      list(APPEND _version "${CMAKE_MATCH_1}")
    endforeach()
    list(JOIN _version "." _version)
  endif()
  set(${out} "${_version}" PARENT_SCOPE)
endfunction()

# ---------------------------------------------------------------- OpenBLAS
set(NABLA_OPENBLAS_LIBRARIES "")
set(_openblas_how "")
if(PKG_CONFIG_FOUND)
  pkg_check_modules(NABLA_PC_OPENBLAS QUIET openblas)
endif()
if(NABLA_PC_OPENBLAS_FOUND)
  find_path(NABLA_OPENBLAS_INCLUDE_DIR cblas.h
            HINTS ${NABLA_PC_OPENBLAS_INCLUDE_DIRS} NO_DEFAULT_PATH)
  if(NABLA_OPENBLAS_INCLUDE_DIR AND NABLA_PC_OPENBLAS_LINK_LIBRARIES)
    set(NABLA_OPENBLAS_LIBRARIES ${NABLA_PC_OPENBLAS_LINK_LIBRARIES})
    set(_openblas_how "pkg-config openblas ${NABLA_PC_OPENBLAS_VERSION}")
  endif()
endif()
if(NOT NABLA_OPENBLAS_LIBRARIES)
  find_path(NABLA_OPENBLAS_INCLUDE_DIR cblas.h
            PATH_SUFFIXES openblas openblas-pthread x86_64-linux-gnu/openblas-pthread)
  find_library(NABLA_OPENBLAS_LIBRARY NAMES openblas
               PATH_SUFFIXES openblas-pthread x86_64-linux-gnu/openblas-pthread)
  if(NABLA_OPENBLAS_INCLUDE_DIR AND NABLA_OPENBLAS_LIBRARY)
    set(NABLA_OPENBLAS_LIBRARIES ${NABLA_OPENBLAS_LIBRARY})
    set(_openblas_how "search")
  endif()
endif()
if(NOT NABLA_OPENBLAS_INCLUDE_DIR OR NOT NABLA_OPENBLAS_LIBRARIES)
  message(FATAL_ERROR
    "OpenBLAS not found: nabla needs cblas.h and libopenblas.\n"
    "On Debian or Ubuntu install the package libopenblas-dev "
    "(`make deps` does it), or point CMAKE_PREFIX_PATH at an OpenBLAS install.")
endif()
list(APPEND NABLA_PRIVATE_INCLUDE_DIRS ${NABLA_OPENBLAS_INCLUDE_DIR})
list(JOIN NABLA_OPENBLAS_LIBRARIES " " _openblas_libs)
set(NABLA_OPENBLAS_SUMMARY "${_openblas_libs} (${_openblas_how}; cblas.h in ${NABLA_OPENBLAS_INCLUDE_DIR})")

# ------------------------------------------------------------------ oneDNN
# The CPU's primitive library beside OpenBLAS (tensor/cpu/dnnl.c): bf16
# matmul and convolutions. Debian's libdnnl-dev ships no pkg-config file, so
# the header and library are searched for directly.
nabla_find_required(DNNL dnnl.h dnnl libdnnl-dev "a oneDNN install"
  "oneDNN not found: nabla needs dnnl.h and libdnnl (version 2.x)" PATH_SUFFIXES oneapi/dnnl)
set(NABLA_DNNL_LIBRARIES ${NABLA_DNNL_LIBRARY})
set(_dnnl_version "")
if(EXISTS "${NABLA_DNNL_INCLUDE_DIR}/dnnl_version.h")
  file(STRINGS "${NABLA_DNNL_INCLUDE_DIR}/dnnl_version.h" _dnnl_v REGEX "define DNNL_VERSION_(MAJOR|MINOR|PATCH) ")
  string(REGEX REPLACE ".*MAJOR ([0-9]+).*MINOR ([0-9]+).*PATCH ([0-9]+).*" "\\1.\\2.\\3" _dnnl_version "${_dnnl_v}")
endif()
# With the OpenMP runtime (Debian's build) tensor/cpu/dnnl.c sets oneDNN's
# thread count through omp_set_num_threads, so it links the OpenMP library
# (libgomp, which libdnnl loads anyway) without compiling anything as OpenMP.
set(_dnnl_runtime "")
if(EXISTS "${NABLA_DNNL_INCLUDE_DIR}/dnnl_config.h")
  file(STRINGS "${NABLA_DNNL_INCLUDE_DIR}/dnnl_config.h" _dnnl_rt REGEX "define DNNL_CPU_RUNTIME ")
  string(REGEX REPLACE ".*DNNL_RUNTIME_([A-Z]+).*" "\\1" _dnnl_runtime "${_dnnl_rt}")
endif()
if(_dnnl_runtime STREQUAL "OMP")
  find_package(OpenMP COMPONENTS C)
  if(NOT OpenMP_C_FOUND OR NOT OpenMP_C_LIBRARIES)
    message(FATAL_ERROR "oneDNN (${NABLA_DNNL_LIBRARY}) uses OpenMP, but no OpenMP library for C was found")
  endif()
  list(APPEND NABLA_DNNL_LIBRARIES ${OpenMP_C_LIBRARIES})
endif()
set(NABLA_DNNL_SUMMARY "${NABLA_DNNL_LIBRARY} ${_dnnl_version}, CPU runtime ${_dnnl_runtime} (dnnl.h in ${NABLA_DNNL_INCLUDE_DIR})")

# ---------------------------------------------------------------- libcrypto
# The store proves the run's secret with HMAC-SHA256 and draws its nonces
# from OpenSSL's libcrypto (distributed/store_auth.c); Debian's libssl-dev.
nabla_find_required(CRYPTO openssl/evp.h crypto libssl-dev "an OpenSSL 3 install"
  "OpenSSL's libcrypto not found: nabla's store authenticates with it")
set(NABLA_CRYPTO_LIBRARIES ${NABLA_CRYPTO_LIBRARY})
set(NABLA_CRYPTO_SUMMARY "${NABLA_CRYPTO_LIBRARY} (openssl/evp.h in ${NABLA_CRYPTO_INCLUDE_DIR})")

# ---------------------------------------------------------- cudnn-frontend
# cuDNN's fused attention (tensor/cuda/attention_cudnn.cpp) is written
# against NVIDIA's cudnn-frontend, a header-only C++ library shipped on PyPI
# as nvidia-cudnn-frontend. It is not ours and never committed: its include/
# is taken from NABLA_CUDNN_FRONTEND_ROOT, from .deps/cudnn_frontend
# (dev/fetch_debs.sh, for a machine without a package registry), from an
# earlier fetch in this build tree, or fetched now into the build tree with
# `pip download` and unpacked (CMake reads the wheel as a zip). Without it the
# CUDA plugin is built with the cuDNN attention path left out, and the
# summary says why. It needs libnvrtc at run time (cuDNN compiles some of its
# attention kernels when a graph is built).
set(NABLA_CUDNN_FRONTEND_VERSION "1.32.0" CACHE STRING
    "nvidia-cudnn-frontend version the build fetches with pip")
set(NABLA_CUDNN_FRONTEND_ROOT "" CACHE PATH
    "Prefix holding cudnn-frontend's include/cudnn_frontend.h (empty: .deps, the build tree, or pip)")
set(NABLA_CUDNN_FRONTEND_INCLUDE_DIR "")
function(nabla_cudnn_frontend out_line)
  set(_fe_build ${CMAKE_BINARY_DIR}/_deps/cudnn_frontend)
  set(_fe_roots ${NABLA_CUDNN_FRONTEND_ROOT} ${PROJECT_SOURCE_DIR}/.deps/cudnn_frontend ${_fe_build})
  set(_dir "")
  foreach(_r ${_fe_roots})
    if(NOT _dir AND EXISTS "${_r}/include/cudnn_frontend.h")
      set(_dir "${_r}/include")
    endif()
  endforeach()
  set(_why "")
  if(NOT _dir AND NOT NABLA_PYTHON3)
    set(_why "no python3 to fetch it with pip")
  elseif(NOT _dir)
    message(STATUS "Fetching the cudnn-frontend ${NABLA_CUDNN_FRONTEND_VERSION} headers (pip download nvidia-cudnn-frontend)")
    file(REMOVE_RECURSE ${_fe_build})
    execute_process(
      COMMAND "${NABLA_PYTHON3}" -m pip download --no-deps --only-binary=:all: --disable-pip-version-check
              --timeout 15 --retries 1 -q -d ${_fe_build}/wheel
              nvidia-cudnn-frontend==${NABLA_CUDNN_FRONTEND_VERSION}
      RESULT_VARIABLE _rc OUTPUT_VARIABLE _out ERROR_VARIABLE _out TIMEOUT 300)
    file(GLOB _whl ${_fe_build}/wheel/*.whl)
    if(_rc EQUAL 0 AND _whl)
      list(GET _whl 0 _whl)
      file(ARCHIVE_EXTRACT INPUT ${_whl} DESTINATION ${_fe_build}/unpacked PATTERNS include)
      if(EXISTS ${_fe_build}/unpacked/include/cudnn_frontend.h)
        file(RENAME ${_fe_build}/unpacked/include ${_fe_build}/include)
        set(_dir ${_fe_build}/include)
      else()
        set(_why "the nvidia-cudnn-frontend wheel has no include/cudnn_frontend.h")
      endif()
      file(REMOVE_RECURSE ${_fe_build}/wheel ${_fe_build}/unpacked)
    else()
      string(REGEX REPLACE "\n.*" "" _out "${_out}")
      set(_why "pip download nvidia-cudnn-frontend==${NABLA_CUDNN_FRONTEND_VERSION} failed: ${_out}")
    endif()
  endif()
  if(_dir AND NOT CUDA_nvrtc_LIBRARY)
    set(_why "the CUDA toolkit has no libnvrtc")
    set(_dir "")
  endif()
  if(_dir)
    nabla_header_version(_fe_version "${_dir}/cudnn_frontend_version.h"
                         CUDNN_FRONTEND_MAJOR_VERSION CUDNN_FRONTEND_MINOR_VERSION
                         CUDNN_FRONTEND_PATCH_VERSION)
    set(NABLA_CUDNN_FRONTEND_INCLUDE_DIR ${_dir} PARENT_SCOPE)
    set(NABLA_CUDA_LIBRARIES ${NABLA_CUDA_LIBRARIES} ${CUDA_nvrtc_LIBRARY} PARENT_SCOPE)
    set(${out_line} "cuDNN attention: on, cudnn-frontend ${_fe_version}: ${_dir}" PARENT_SCOPE)
  else()
    message(STATUS "cuDNN's fused attention left out: ${_why}")
    set(${out_line} "cuDNN attention: off (${_why}); nabla's own attention kernels only" PARENT_SCOPE)
  endif()
endfunction()

# -------------------------------------------------------------------- CUDA
nabla_tristate(NABLA_CUDA)
set(NABLA_HAVE_CUDA 0)
set(NABLA_CUDA_SUMMARY "")

macro(nabla_cuda_missing reason)
  nabla_missing(CUDA _cuda_ok "${reason}" "Install it, set NABLA_CUDA_EXTRA_ROOT to its prefix,")
endmacro()

if(NABLA_CUDA_MODE STREQUAL "OFF")
  set(NABLA_CUDA_SUMMARY "off (NABLA_CUDA=OFF)")
else()
  set(_cuda_ok TRUE)

  # nvcc: the one CMake was given, else PATH, $CUDA_HOME, /usr/local/cuda.
  if(CMAKE_CUDA_COMPILER)
    set(NABLA_NVCC "${CMAKE_CUDA_COMPILER}")
  else()
    find_program(NABLA_NVCC nvcc
      HINTS ENV CUDA_HOME ENV CUDA_PATH ENV CUDA_ROOT PATH_SUFFIXES bin
      PATHS /usr/local/cuda/bin /opt/cuda/bin)
  endif()
  if(NOT NABLA_NVCC)
    nabla_cuda_missing("nvcc was not found (looked in PATH, $CUDA_HOME/bin and /usr/local/cuda/bin)")
  endif()

  if(_cuda_ok)
    execute_process(COMMAND "${NABLA_NVCC}" --version
                    OUTPUT_VARIABLE _nvcc_out ERROR_QUIET RESULT_VARIABLE _nvcc_rc)
    string(REGEX MATCH "V([0-9]+\\.[0-9]+\\.[0-9]+)" _m "${_nvcc_out}")
    set(NABLA_NVCC_VERSION "${CMAKE_MATCH_1}")
    if(NOT _nvcc_rc EQUAL 0 OR NOT NABLA_NVCC_VERSION)
      nabla_cuda_missing("`${NABLA_NVCC} --version` did not run or named no version")
    endif()
  endif()

  if(_cuda_ok)
    get_filename_component(_nvcc_bin "${NABLA_NVCC}" DIRECTORY)
    get_filename_component(NABLA_CUDA_ROOT "${_nvcc_bin}" DIRECTORY)

    # Prefixes for cuDNN and NCCL: the hint, the toolkit, then the pip wheels
    # (site-packages/nvidia/{cudnn,nccl}) of the python3 in PATH; system
    # directories are searched after all of them.
    set(_cudnn_roots ${NABLA_CUDA_EXTRA_ROOT} $ENV{CUDNN_ROOT} ${NABLA_CUDA_ROOT})
    set(_nccl_roots ${NABLA_CUDA_EXTRA_ROOT} $ENV{NCCL_ROOT} ${NABLA_CUDA_ROOT})
    find_program(NABLA_PYTHON3 NAMES python3 python)
    if(NABLA_PYTHON3)
      execute_process(
        COMMAND "${NABLA_PYTHON3}" -c
          "import site, sysconfig\nd = set(getattr(site, 'getsitepackages', lambda: [])())\nd.add(site.getusersitepackages())\nd.update(sysconfig.get_paths()[k] for k in ('purelib', 'platlib'))\nprint(';'.join(sorted(d)))"
        OUTPUT_VARIABLE _site_dirs OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
      foreach(_d ${_site_dirs})
        list(APPEND _cudnn_roots "${_d}/nvidia/cudnn")
        list(APPEND _nccl_roots "${_d}/nvidia/nccl")
      endforeach()
    endif()
    # Wheels ship only the versioned names (libcudnn.so.9, libnccl.so.2).
    find_path(NABLA_CUDNN_INCLUDE_DIR cudnn.h HINTS ${_cudnn_roots} PATH_SUFFIXES include)
    find_library(NABLA_CUDNN_LIBRARY NAMES cudnn libcudnn.so.9 libcudnn.so.8 NAMES_PER_DIR
                 HINTS ${_cudnn_roots} PATH_SUFFIXES lib64 lib)
    find_path(NABLA_NCCL_INCLUDE_DIR nccl.h HINTS ${_nccl_roots} PATH_SUFFIXES include)
    find_library(NABLA_NCCL_LIBRARY NAMES nccl libnccl.so.2 NAMES_PER_DIR
                 HINTS ${_nccl_roots} PATH_SUFFIXES lib64 lib)
    if(NOT NABLA_CUDNN_INCLUDE_DIR OR NOT NABLA_CUDNN_LIBRARY)
      nabla_cuda_missing("cuDNN (cudnn.h and libcudnn) was not found under ${NABLA_CUDA_ROOT}, the system directories or a Python environment's nvidia/cudnn")
    elseif(NOT NABLA_NCCL_INCLUDE_DIR OR NOT NABLA_NCCL_LIBRARY)
      nabla_cuda_missing("NCCL (nccl.h and libnccl) was not found under ${NABLA_CUDA_ROOT}, the system directories or a Python environment's nvidia/nccl")
    endif()
  endif()

  # Can nvcc compile with this host compiler? Asked before enable_language,
  # whose failure could not be turned into AUTO's "off".
  if(_cuda_ok AND NOT NABLA_NVCC_PROBED STREQUAL NABLA_NVCC)
    set(_probe_dir ${CMAKE_BINARY_DIR}/CMakeFiles/nabla_nvcc_probe)
    file(WRITE ${_probe_dir}/probe.cu "__global__ void nabla_probe(float *x) { x[threadIdx.x] = 1.0f; }\n")
    set(_probe_flags "")
    if(CMAKE_CUDA_HOST_COMPILER)
      set(_probe_flags -ccbin "${CMAKE_CUDA_HOST_COMPILER}")
    endif()
    execute_process(
      COMMAND "${NABLA_NVCC}" ${_probe_flags} -arch=sm_80 -c probe.cu -o probe.o
      WORKING_DIRECTORY ${_probe_dir}
      RESULT_VARIABLE _probe_rc OUTPUT_VARIABLE _probe_out ERROR_VARIABLE _probe_out)
    if(NOT _probe_rc EQUAL 0)
      message(STATUS "nvcc test compile failed:\n${_probe_out}")
      nabla_cuda_missing("${NABLA_NVCC} cannot compile a test kernel (its output is above)")
    else()
      set(NABLA_NVCC_PROBED "${NABLA_NVCC}" CACHE INTERNAL "nvcc that compiled the probe kernel")
    endif()
  endif()

  if(_cuda_ok)
    set(CMAKE_CUDA_COMPILER "${NABLA_NVCC}")
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      # sm_80 and sm_90 machine code, plus sm_90 PTX for newer GPUs.
      set(CMAKE_CUDA_ARCHITECTURES "80-real;90-real;90-virtual")
    endif()
    set(CMAKE_CUDA_STANDARD 17)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    # The same libcudart.so that the C code links, not a static copy.
    set(CMAKE_CUDA_RUNTIME_LIBRARY Shared)
    enable_language(CUDA)
    # tensor/cuda/attention_cudnn.cpp (nvcc needs a host C++ compiler anyway)
    set(CMAKE_CXX_STANDARD 17)
    set(CMAKE_CXX_STANDARD_REQUIRED ON)
    set(CMAKE_CXX_EXTENSIONS OFF)
    enable_language(CXX)
    set(CUDAToolkit_ROOT "${NABLA_CUDA_ROOT}")
    find_package(CUDAToolkit REQUIRED)
    foreach(_lib cudart cublas cublasLt)
      if(NOT CUDA_${_lib}_LIBRARY)
        message(FATAL_ERROR "CUDA toolkit at ${NABLA_CUDA_ROOT} has no lib${_lib}")
      endif()
    endforeach()
    set(NABLA_HAVE_CUDA 1)
    list(APPEND NABLA_CUDA_LIBRARIES
      ${CUDA_cudart_LIBRARY} ${CUDA_cublas_LIBRARY} ${CUDA_cublasLt_LIBRARY}
      ${NABLA_CUDNN_LIBRARY} ${NABLA_NCCL_LIBRARY})
    list(APPEND NABLA_PRIVATE_INCLUDE_DIRS
      ${CUDAToolkit_INCLUDE_DIRS} ${NABLA_CUDNN_INCLUDE_DIR} ${NABLA_NCCL_INCLUDE_DIR})
    list(REMOVE_DUPLICATES NABLA_PRIVATE_INCLUDE_DIRS)

    nabla_header_version(_cudnn_version "${NABLA_CUDNN_INCLUDE_DIR}/cudnn_version.h"
                         CUDNN_MAJOR CUDNN_MINOR CUDNN_PATCHLEVEL)
    if(NOT _cudnn_version)
      nabla_header_version(_cudnn_version "${NABLA_CUDNN_INCLUDE_DIR}/cudnn.h"
                           CUDNN_MAJOR CUDNN_MINOR CUDNN_PATCHLEVEL)
    endif()
    nabla_header_version(_nccl_version "${NABLA_NCCL_INCLUDE_DIR}/nccl.h"
                         NCCL_MAJOR NCCL_MINOR NCCL_PATCH)
    nabla_cudnn_frontend(_fe_line)
    list(JOIN CMAKE_CUDA_ARCHITECTURES ", " _archs)
    set(NABLA_CUDA_SUMMARY "on (NABLA_CUDA=${NABLA_CUDA_MODE})")
    set(NABLA_CUDA_DETAILS
      "nvcc ${NABLA_NVCC_VERSION}: ${NABLA_NVCC}"
      "archs: ${_archs}"
      "cuDNN ${_cudnn_version}: ${NABLA_CUDNN_LIBRARY}"
      "${_fe_line}"
      "NCCL ${_nccl_version}: ${NABLA_NCCL_LIBRARY}")
  elseif(NABLA_NVCC)
    set(NABLA_CUDA_DETAILS "nvcc ${NABLA_NVCC_VERSION}: ${NABLA_NVCC}")
  endif()
endif()

# -------------------------------------------------------------------- Gloo
nabla_tristate(NABLA_GLOO)
set(NABLA_HAVE_GLOO 0)
macro(nabla_gloo_missing reason)
  nabla_missing(GLOO _gloo_ok "${reason}"
    "On Debian or Ubuntu install the packages libgloo-dev and g++ (`make deps` does it),")
endmacro()

if(NABLA_GLOO_MODE STREQUAL "OFF")
  set(NABLA_GLOO_SUMMARY "off (NABLA_GLOO=OFF)")
else()
  set(_gloo_ok TRUE)
  find_path(NABLA_GLOO_INCLUDE_DIR gloo/config.h)
  find_library(NABLA_GLOO_LIBRARY gloo)
  if(NOT NABLA_GLOO_INCLUDE_DIR OR NOT NABLA_GLOO_LIBRARY)
    nabla_gloo_missing("the Gloo headers (gloo/config.h) or libgloo were not found")
  else()
    include(CheckLanguage)
    check_language(CXX)
    if(NOT CMAKE_CXX_COMPILER)
      nabla_gloo_missing("no C++ compiler was found for the Gloo shim")
    endif()
  endif()
  if(_gloo_ok)
    set(CMAKE_CXX_STANDARD 17)
    set(CMAKE_CXX_STANDARD_REQUIRED ON)
    set(CMAKE_CXX_EXTENSIONS OFF)
    enable_language(CXX)
    set(NABLA_HAVE_GLOO 1)
    list(APPEND NABLA_BACKEND_LIBRARIES ${NABLA_GLOO_LIBRARY})
    list(APPEND NABLA_PRIVATE_INCLUDE_DIRS ${NABLA_GLOO_INCLUDE_DIR})
    nabla_header_version(_gloo_version "${NABLA_GLOO_INCLUDE_DIR}/gloo/config.h"
                         GLOO_VERSION_MAJOR GLOO_VERSION_MINOR GLOO_VERSION_PATCH)
    set(NABLA_GLOO_SUMMARY "on (NABLA_GLOO=${NABLA_GLOO_MODE}): Gloo ${_gloo_version}, ${NABLA_GLOO_LIBRARY}")
  endif()
endif()
