# Test discovery. Every tests/test_*.c is one Check executable in
# ${CMAKE_BINARY_DIR}/tests, linked with tests/testutil.c (when present), the
# static library and Check; every tests/*.py runs under python3. All run from
# the build directory. Labels: unit, or gpu for tests/test_cuda_*.c.
# tests/test_install.py has the label install; the CUDA kernel emulator's
# drivers (dev/cuda_emu) the label emu (cmake/NablaEmuTests.cmake). Exit code 77 means "skipped"
# (e.g. no GPU; a missing dependency of a .py test fails instead under
# CI=true: tests/_programs.py's skip()). A GPU suite whose source calls
# nbt_parity or nbt_device also runs as <suite>_logic (label cpu) with
# NBT_PARITY_DEVICE=cpu: the side under test on the CPU, which checks the
# tests' own logic without a GPU (Note [CPU stand-in mode] in
# tests/cuda_parity.h).

file(GLOB NABLA_TEST_SOURCES CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tests/test_*.c)
file(GLOB NABLA_PY_TESTS CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tests/*.py)

set(NABLA_TEST_ENVIRONMENT
  CK_DEFAULT_TIMEOUT=120
  NABLA_SOURCE_DIR=${PROJECT_SOURCE_DIR}
  NABLA_BINARY_DIR=${CMAKE_BINARY_DIR}
  NABLA_BIN_DIR=${CMAKE_BINARY_DIR}/bin)
if(NABLA_SANITIZE)
  # The CUDA runtime maps memory where ASan keeps its shadow gap.
  # Programs a test compiles against the build's library need the same
  # runtime (tests/test_plugin_abi.py adds NABLA_TEST_CFLAGS).
  list(APPEND NABLA_TEST_ENVIRONMENT
    ASAN_OPTIONS=protect_shadow_gap=0:detect_stack_use_after_return=1
    UBSAN_OPTIONS=print_stacktrace=1
    NABLA_TEST_CFLAGS=-fsanitize=address,undefined)
endif()
# Deadlines stretch by this factor: a Debug build under ASan and UBSan runs
# the programs several times slower, so a test's time limit (CTest's, Check's
# through CK_TIMEOUT_MULTIPLIER, the Python tests' through
# NABLA_TEST_TIME_SCALE in tests/_programs.py) is a limit on a hang there,
# not on the sanitizers' cost. Numbers of steps and tolerances never change.
if(NABLA_SANITIZE)
  set(_scale_default 4)
else()
  set(_scale_default 1)
endif()
set(NABLA_TEST_TIME_SCALE ${_scale_default} CACHE STRING
    "Factor on every test's time limit (4 by default with NABLA_SANITIZE)")
list(APPEND NABLA_TEST_ENVIRONMENT
  CK_TIMEOUT_MULTIPLIER=${NABLA_TEST_TIME_SCALE}
  NABLA_TEST_TIME_SCALE=${NABLA_TEST_TIME_SCALE})

set(NABLA_TESTS "")
if(NABLA_TEST_SOURCES)
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(NABLA_CHECK QUIET IMPORTED_TARGET check)
  endif()
  if(NOT NABLA_CHECK_FOUND)
    message(FATAL_ERROR
      "The Check unit-test library was not found (pkg-config module check).\n"
      "On Debian or Ubuntu install the packages check, libsubunit-dev and pkg-config "
      "(`make deps` does it), or configure with -DNABLA_BUILD_TESTS=OFF.")
  endif()

  # A glob, so that the build notices when testutil.c appears. The CUDA
  # parity harness (cuda_parity.c) goes in with it.
  file(GLOB _testutil CONFIGURE_DEPENDS ${PROJECT_SOURCE_DIR}/tests/testutil.c
       ${PROJECT_SOURCE_DIR}/tests/cuda_parity.c)
  if(_testutil)
    add_library(nabla_testutil STATIC ${_testutil})
    target_link_libraries(nabla_testutil PUBLIC nabla nabla_internal PkgConfig::NABLA_CHECK)
    target_include_directories(nabla_testutil PUBLIC ${PROJECT_SOURCE_DIR}/tests)
    set_target_properties(nabla_testutil PROPERTIES LINKER_LANGUAGE ${NABLA_LINKER_LANGUAGE})
    nabla_own_flags(nabla_testutil)
  endif()

  foreach(_src ${NABLA_TEST_SOURCES})
    get_filename_component(_name ${_src} NAME_WE)
    add_executable(${_name} ${_src})
    set_target_properties(${_name} PROPERTIES
      RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/tests
      LINKER_LANGUAGE ${NABLA_LINKER_LANGUAGE})
    if(_name STREQUAL "test_plugin")
      # A program linked with libnabla.so, which opens the CUDA plugin
      # (libnabla.a has the backend linked in): public functions only.
      target_sources(${_name} PRIVATE ${PROJECT_SOURCE_DIR}/tests/testutil.c)
      target_link_libraries(${_name} PRIVATE nabla_shared PkgConfig::NABLA_CHECK)
      target_compile_definitions(${_name} PRIVATE NABLA_HAVE_CUDA=${NABLA_HAVE_CUDA}
                                 ${NABLA_C_DEFINES})
      if(TARGET nabla_cuda)
        add_dependencies(${_name} nabla_cuda)
      endif()
    else()
      if(TARGET nabla_testutil)
        target_link_libraries(${_name} PRIVATE nabla_testutil)
      endif()
      target_link_libraries(${_name} PRIVATE nabla nabla_internal PkgConfig::NABLA_CHECK)
    endif()
    target_include_directories(${_name} PRIVATE ${PROJECT_SOURCE_DIR}/tests)
    target_compile_definitions(${_name} PRIVATE
      NABLA_SOURCE_DIR="${PROJECT_SOURCE_DIR}" NABLA_BINARY_DIR="${CMAKE_BINARY_DIR}")
    nabla_own_flags(${_name})

    if(_name MATCHES "^test_cuda_")
      set(_label gpu)
    else()
      set(_label unit)
    endif()
    add_test(NAME ${_name} COMMAND ${_name} WORKING_DIRECTORY ${CMAKE_BINARY_DIR})
    set_tests_properties(${_name} PROPERTIES
      LABELS ${_label} TIMEOUT 300 SKIP_RETURN_CODE 77
      ENVIRONMENT "${NABLA_TEST_ENVIRONMENT}")
    list(APPEND NABLA_TESTS ${_name})

    if(_label STREQUAL "gpu")
      # re-read when the suite changes
      set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_src})
      file(READ ${_src} _text)
      if(_text MATCHES "nbt_parity\\(|nbt_device\\(\\)")
        add_test(NAME ${_name}_logic COMMAND ${_name} WORKING_DIRECTORY ${CMAKE_BINARY_DIR})
        # no SKIP_RETURN_CODE: this mode needs no GPU, so a skip is a failure
        set_tests_properties(${_name}_logic PROPERTIES
          LABELS cpu TIMEOUT 300
          ENVIRONMENT "${NABLA_TEST_ENVIRONMENT};NBT_PARITY_DEVICE=cpu")
        list(APPEND NABLA_TESTS ${_name}_logic)
      endif()
    endif()
  endforeach()
  # Suite `exe` again as test `name`, under one more environment setting.
  macro(nabla_env_variant name exe setting)
    add_test(NAME ${name} COMMAND ${exe} WORKING_DIRECTORY ${CMAKE_BINARY_DIR})
    set_tests_properties(${name} PROPERTIES LABELS unit TIMEOUT 300
      ENVIRONMENT "${NABLA_TEST_ENVIRONMENT};${setting}")
    list(APPEND NABLA_TESTS ${name})
  endmacro()
  if(TARGET test_config)
    # OpenBLAS on its generic SSE3 core, as on a CPU it does not know (the one test that
    # sets OPENBLAS_CORETYPE): f32 products and convolutions must still take oneDNN
    nabla_env_variant(test_config_prescott test_config OPENBLAS_CORETYPE=Prescott)
  endif()
  if(TARGET test_dnnl)
    # oneDNN limited to AVX2, as on a CPU without AVX-512: bf16 through the f32 fallbacks
    nabla_env_variant(test_dnnl_avx2 test_dnnl ONEDNN_MAX_CPU_ISA=AVX2)
    # held to AVX-512 core without BF16 (a no-op below it): oneDNN has bf16 kernels there,
    # emulated, and the rule must leave bf16 products to the f32 fallbacks
    nabla_env_variant(test_dnnl_avx512 test_dnnl ONEDNN_MAX_CPU_ISA=AVX512_CORE)
    # OpenBLAS on its generic core: the f32 convolutions' GEMMs on oneDNN's (test_conv_f32_auto)
    nabla_env_variant(test_dnnl_prescott test_dnnl OPENBLAS_CORETYPE=Prescott)
  endif()
endif()

if(NABLA_PY_TESTS)
  find_program(NABLA_PYTHON3 NAMES python3)
  if(NOT NABLA_PYTHON3)
    message(WARNING "python3 not found: tests/*.py are not registered")
  else()
    foreach(_src ${NABLA_PY_TESTS})
      get_filename_component(_file ${_src} NAME)
      if(_file MATCHES "^_")  # __init__.py, _helpers.py: modules, not tests
        continue()
      endif()
      set(_label unit)
      set(_env "${NABLA_TEST_ENVIRONMENT}")
      if(_file STREQUAL "test_install.py")
        # Installs into a temporary prefix and builds a program against it:
        # not with sanitizers, whose runtime an outside program would not link.
        if(NABLA_SANITIZE)
          continue()
        endif()
        set(_label install)
        list(APPEND _env NABLA_CMAKE=${CMAKE_COMMAND} NABLA_CC=${CMAKE_C_COMPILER})
      endif()
      if(_file STREQUAL "test_scale_netns.py")
        set(_label netns)  # shaped links in network namespaces: skipped where they cannot be made
      endif()
      add_test(NAME ${_file} COMMAND ${NABLA_PYTHON3} ${_src} WORKING_DIRECTORY ${CMAKE_BINARY_DIR})
      set_tests_properties(${_file} PROPERTIES
        LABELS ${_label} TIMEOUT 300 SKIP_RETURN_CODE 77
        ENVIRONMENT "${_env}")
      list(APPEND NABLA_TESTS ${_file})
    endforeach()
  endif()
endif()
include(${PROJECT_SOURCE_DIR}/cmake/NablaDistTests.cmake)
include(${PROJECT_SOURCE_DIR}/cmake/NablaEmuTests.cmake)

# Every test's CTest limit times NABLA_TEST_TIME_SCALE (above).
if(NOT NABLA_TEST_TIME_SCALE EQUAL 1)
  foreach(_t IN LISTS NABLA_TESTS)
    get_test_property(${_t} TIMEOUT _limit)
    if(_limit)
      math(EXPR _limit "${_limit} * ${NABLA_TEST_TIME_SCALE}")
      set_tests_properties(${_t} PROPERTIES TIMEOUT ${_limit})
    endif()
  endforeach()
endif()
