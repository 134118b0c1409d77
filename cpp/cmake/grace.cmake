# Is the build host an NVIDIA Grace (Arm Neoverse-V2)? Used by CMakeLists.txt when
# ALPSCK_TUNE_GRACE is AUTO, and only for a native build on aarch64.
#
#   alpsck_host_is_neoverse_v2(<result> <why> [ROOT <dir>])
#
# <result> is TRUE when every core the kernel lists is implementer 0x41 (Arm), part 0xd4f
# (Neoverse-V2), and at least one is listed; <why> says what was found, for the status message.
# The cores come from /proc/cpuinfo ("CPU implementer : 0x41", "CPU part : 0xd4f"); where it
# lists none (some containers), from /sys/devices/system/cpu/cpu*/regs/identification/midr_el1
# (MIDR_EL1: implementer in bits 31:24, part in bits 15:4). Every core must match: tuning for
# the Neoverse-V2 on a host whose other cores are not one would build code they cannot run.
# ROOT prefixes both paths (the tests point it at a fake tree).
#
# Run as a script it prints "<result>: <why>" for ROOT (tests/process/test_doctor.py):
#   cmake -DROOT=/tmp/fake -P cpp/cmake/grace.cmake

function(alpsck_host_is_neoverse_v2 result why)
  cmake_parse_arguments(PARSE_ARGV 2 arg "" "ROOT" "")
  set(pairs "")  # one "implementer/part" per core, e.g. 0x41/0xd4f
  set(cpuinfo "${arg_ROOT}/proc/cpuinfo")
  if(EXISTS "${cpuinfo}")
    file(STRINGS "${cpuinfo}" lines REGEX "^CPU (implementer|part)[ \t]*:")
    set(implementer "")
    foreach(line IN LISTS lines)
      string(TOLOWER "${line}" line)
      if(line MATCHES "^cpu implementer[ \t]*:[ \t]*(0x[0-9a-f]+)")
        set(implementer "${CMAKE_MATCH_1}")
      elseif(line MATCHES "^cpu part[ \t]*:[ \t]*(0x[0-9a-f]+)")
        list(APPEND pairs "${implementer}/${CMAKE_MATCH_1}")
        set(implementer "")
      endif()
    endforeach()
  endif()
  set(source "${cpuinfo}")
  if(NOT pairs)
    file(GLOB midrs "${arg_ROOT}/sys/devices/system/cpu/cpu*/regs/identification/midr_el1")
    foreach(f IN LISTS midrs)
      file(STRINGS "${f}" midr LIMIT_COUNT 1)
      string(STRIP "${midr}" midr)
      if(midr MATCHES "^0x[0-9a-fA-F]+$")
        math(EXPR imp "(${midr} >> 24) & 0xff" OUTPUT_FORMAT HEXADECIMAL)
        math(EXPR part "(${midr} >> 4) & 0xfff" OUTPUT_FORMAT HEXADECIMAL)
        string(TOLOWER "${imp}/${part}" pair)
        list(APPEND pairs "${pair}")
      endif()
    endforeach()
    set(source "MIDR_EL1 in ${arg_ROOT}/sys/devices/system/cpu")
  endif()
  if(NOT pairs)
    set(${result} FALSE PARENT_SCOPE)
    set(${why} "no CPU implementer/part in ${cpuinfo} nor MIDR_EL1 in ${arg_ROOT}/sys/devices/system/cpu" PARENT_SCOPE)
    return()
  endif()
  list(LENGTH pairs n)
  set(kinds ${pairs})
  list(REMOVE_DUPLICATES kinds)
  string(REPLACE ";" ", " seen "${kinds}")
  if(kinds STREQUAL "0x41/0xd4f")
    set(${result} TRUE PARENT_SCOPE)
    set(${why} "${n} Neoverse-V2 cores (implementer/part 0x41/0xd4f, from ${source})" PARENT_SCOPE)
  else()
    set(${result} FALSE PARENT_SCOPE)
    set(${why} "implementer/part ${seen} across ${n} cores (from ${source}); Neoverse-V2 is 0x41/0xd4f" PARENT_SCOPE)
  endif()
endfunction()

if(CMAKE_SCRIPT_MODE_FILE STREQUAL CMAKE_CURRENT_LIST_FILE)
  if(ROOT)
    alpsck_host_is_neoverse_v2(is why ROOT "${ROOT}")
  else()
    alpsck_host_is_neoverse_v2(is why)
  endif()
  message(STATUS "${is}: ${why}")
endif()
