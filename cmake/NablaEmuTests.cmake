# The CUDA kernel emulator (dev/cuda_emu, README.md there) as CTest tests,
# label emu: `ctest -L emu` builds the emulator (cuda_emu_build, a fixture)
# and runs each driver as cuda_emu_<driver>. They need no GPU, but they run
# a CPU thread per CUDA thread of every block: about six CPU-minutes in all,
# over ten minutes on two busy cores. So `make test` leaves them out
# (ctest -LE emu) and `make test-emu` runs them. Included by NablaTests.cmake.
#
# The emulator links a CPU-only libnabla.a: this build's, when it is one
# (no CUDA, no sanitizers); otherwise the emulator's Makefile configures
# and builds its own next to the drivers.

find_program(NABLA_MAKE NAMES make gmake)
find_program(NABLA_GXX NAMES g++)
if(NOT NABLA_MAKE OR NOT NABLA_GXX OR NOT NABLA_PYTHON3)
  message(STATUS "cuda_emu tests not registered: they need make, g++ and python3")
  return()
endif()

set(_emu_dir ${PROJECT_SOURCE_DIR}/dev/cuda_emu)
set(_emu_build ${CMAKE_BINARY_DIR}/cuda_emu)
set(_emu_args -C ${_emu_dir} B=${_emu_build} CXX=${NABLA_GXX})
if(NOT NABLA_HAVE_CUDA AND NOT NABLA_SANITIZE)
  list(APPEND _emu_args NABLA_BUILD=${CMAKE_BINARY_DIR})
endif()

# The drivers: the Makefile's DRIVERS list, the one place that names them.
set_property(DIRECTORY APPEND PROPERTY CMAKE_CONFIGURE_DEPENDS ${_emu_dir}/Makefile)
file(STRINGS ${_emu_dir}/Makefile _emu_line REGEX "^DRIVERS[ \t]*:=")
string(REGEX REPLACE "^DRIVERS[ \t]*:=[ \t]*" "" _emu_drivers "${_emu_line}")
separate_arguments(_emu_drivers UNIX_COMMAND "${_emu_drivers}")
if(NOT _emu_drivers)
  message(FATAL_ERROR "dev/cuda_emu/Makefile: no DRIVERS := line to register the emulator's tests from")
endif()

add_test(NAME cuda_emu_build COMMAND ${NABLA_MAKE} ${_emu_args} build)
set_tests_properties(cuda_emu_build PROPERTIES
  LABELS emu TIMEOUT 1800 FIXTURES_SETUP cuda_emu)
list(APPEND NABLA_TESTS cuda_emu_build)
foreach(_drv ${_emu_drivers})
  add_test(NAME cuda_emu_${_drv} COMMAND ${_emu_build}/drv_${_drv} WORKING_DIRECTORY ${CMAKE_BINARY_DIR})
  set_tests_properties(cuda_emu_${_drv} PROPERTIES
    LABELS emu TIMEOUT 1200 FIXTURES_REQUIRED cuda_emu)
  list(APPEND NABLA_TESTS cuda_emu_${_drv})
endforeach()
