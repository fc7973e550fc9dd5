# Compile flags for nabla's own targets, the sanitizer switch, and the
# conversion of link lists into pkg-config flags.

set(NABLA_WARNINGS -Wall -Wextra -Wshadow -Wno-unused-parameter)

# Warnings (and -Werror when NABLA_WERROR) for a target built from our code.
# nvcc gets the host compiler's warnings without -Wshadow, which the CUDA
# headers themselves trip.
function(nabla_own_flags target)
  target_compile_options(${target} PRIVATE
    "$<$<COMPILE_LANGUAGE:C,CXX>:${NABLA_WARNINGS}>"
    "$<$<COMPILE_LANGUAGE:CUDA>:-Xcompiler=-Wall,-Wextra,-Wno-unused-parameter>")
  if(NABLA_WERROR)
    target_compile_options(${target} PRIVATE
      "$<$<COMPILE_LANGUAGE:C,CXX>:-Werror>"
      "$<$<COMPILE_LANGUAGE:CUDA>:-Werror=all-warnings;-Xcompiler=-Werror>")
  endif()
endfunction()

# A library target of ours exports only what is marked for export
# (NB_API, include/nabla/api.h): C, C++ and CUDA code compiled with
# -fvisibility=hidden, inline functions of C++ headers included.
function(nabla_hidden_symbols target)
  set_target_properties(${target} PROPERTIES
    C_VISIBILITY_PRESET hidden CXX_VISIBILITY_PRESET hidden CUDA_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
endfunction()

if(NABLA_SANITIZE)
  # Everything, third-party code built here included; nvcc's device
  # compiler does not take these, the host objects it makes are not
  # instrumented.
  add_compile_options(
    "$<$<COMPILE_LANGUAGE:C,CXX>:-fsanitize=address,undefined;-fno-omit-frame-pointer;-fno-sanitize-recover=undefined>")
  add_link_options(-fsanitize=address,undefined -fno-sanitize-recover=undefined)
endif()

# out = the pkg-config spelling of a link list: full paths become
# "-L<dir> -l<name>", Threads::Threads becomes -pthread.
function(nabla_pkgconfig_libs out)
  set(_dirs "")
  set(_flags "")
  foreach(_lib ${ARGN})
    if(_lib STREQUAL "Threads::Threads")
      list(APPEND _flags -pthread)
    elseif(IS_ABSOLUTE "${_lib}")
      get_filename_component(_dir "${_lib}" DIRECTORY)
      get_filename_component(_file "${_lib}" NAME)
      string(REGEX REPLACE "^lib" "" _name "${_file}")
      string(REGEX REPLACE "\\.(so|a)(\\.[0-9]+)*$" "" _name "${_name}")
      if(_file MATCHES "\\.so\\.[0-9]+" AND NOT EXISTS "${_dir}/lib${_name}.so")
        # Only a versioned file (pip wheels): link it by its exact name.
        set(_name ":${_file}")
      endif()
      if(NOT _dir IN_LIST CMAKE_C_IMPLICIT_LINK_DIRECTORIES)
        list(APPEND _dirs "-L${_dir}")
      endif()
      list(APPEND _flags "-l${_name}")
    elseif(_lib MATCHES "^-")
      list(APPEND _flags "${_lib}")
    else()
      list(APPEND _flags "-l${_lib}")
    endif()
  endforeach()
  list(REMOVE_DUPLICATES _dirs)
  list(REMOVE_DUPLICATES _flags)
  list(JOIN _dirs " " _dirs)
  list(JOIN _flags " " _flags)
  string(STRIP "${_dirs} ${_flags}" _all)
  set(${out} "${_all}" PARENT_SCOPE)
endfunction()
