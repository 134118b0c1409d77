# Cross build for aarch64 (Alps GH200 nodes are Arm Neoverse-V2) with Debian's
# g++-aarch64-linux-gnu; tests run through qemu-aarch64-static with a 64 KiB page size, as
# GH200 kernels may use.
#
#   cmake -S . -B build-arm64 -DCMAKE_TOOLCHAIN_FILE=cpp/cmake/aarch64-linux-gnu.cmake -DALPSCK_BUILD_TESTS=ON
#   cmake --build build-arm64 && ctest --test-dir build-arm64
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_CXX_COMPILER aarch64-linux-gnu-g++)
set(CMAKE_FIND_ROOT_PATH /usr/aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_FIND_ROOT_PATH_MODE_LIBRARY ONLY)
set(CMAKE_FIND_ROOT_PATH_MODE_INCLUDE ONLY)
find_program(ALPSCK_QEMU_AARCH64 qemu-aarch64-static REQUIRED)
set(CMAKE_CROSSCOMPILING_EMULATOR "${ALPSCK_QEMU_AARCH64};-p;65536;-L;/usr/aarch64-linux-gnu")
