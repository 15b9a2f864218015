# -DDDP_DEPS_BUNDLE=<folder>: a machine without our Debian packages (a lent GPU machine: PyTorch,
# CMake, ninja, a compiler, no package manager) builds with the dependencies of the folder that
# scripts/gpu_bundle.sh makes. Each dependency is taken from the system when the system has it, and
# from the bundle only when it has none, so the option changes nothing on a machine that has them.
#   CLI11, nlohmann_json   header-only: an imported target on the bundle's headers (and, for the
#                          find_package(... REQUIRED) calls below this file, a config file saying so)
#   GoogleTest             built from the bundle's sources (gtest, gtest_main; GTest::* aliases)
#   Gloo's headers         ProcessGroupGloo.hpp includes them and the torch wheel does not ship them:
#                          DDP_GLOO_INCLUDE_DIR, which CMakeLists.txt puts on the library's path
#   zlib, OpenSSL          the bundle's headers, with the system's own libz.so.1 and libcrypto.so.3
#                          (there without their -dev packages: python3's zlib and ssl modules load them)
# What came from where is printed, one line a dependency.
set(DDP_DEPS_BUNDLE "" CACHE PATH "Folder made by scripts/gpu_bundle.sh: dependencies the system lacks are taken from it")
set(DDP_GLOO_INCLUDE_DIR "")
if(NOT DDP_DEPS_BUNDLE)
  return()
endif()
get_filename_component(_bundle "${DDP_DEPS_BUNDLE}" ABSOLUTE)
if(NOT EXISTS "${_bundle}/MANIFEST")
  message(FATAL_ERROR "torchddp: DDP_DEPS_BUNDLE=${DDP_DEPS_BUNDLE} holds no MANIFEST: make it with scripts/gpu_bundle.sh")
endif()
set(_configs "${CMAKE_BINARY_DIR}/deps-bundle")
function(_ddp_bundle_note name where)
  message(STATUS "torchddp: ${name}: ${where}")
endfunction()
# A config file for find_package(<name>) naming targets this file already made.
function(_ddp_bundle_config name version)
  file(WRITE "${_configs}/${name}/${name}Config.cmake"
       "# Written by torchddp's cmake/DepsBundle.cmake: the targets exist already.\nset(${name}_FOUND TRUE)\n")
  include(CMakePackageConfigHelpers)
  write_basic_package_version_file("${_configs}/${name}/${name}ConfigVersion.cmake" VERSION ${version}
                                   COMPATIBILITY SameMajorVersion)
  set(${name}_DIR "${_configs}/${name}" CACHE PATH "" FORCE)
endfunction()
# A package's version as MANIFEST records it (Debian's: epoch and revision dropped).
function(_ddp_bundle_version package out)
  file(STRINGS "${_bundle}/MANIFEST" line REGEX "^${package} ")
  string(REGEX REPLACE "^[^ ]+ ([0-9]+:)?([0-9.]+).*" "\\2" version "${line}")
  set(${out} ${version} PARENT_SCOPE)
endfunction()

# CLI11 (ddprun, the examples: find_package(CLI11 CONFIG QUIET), then if(TARGET CLI11::CLI11)).
find_package(CLI11 CONFIG QUIET)
if(TARGET CLI11::CLI11)
  _ddp_bundle_note(CLI11 "the system's (${CLI11_DIR})")
else()
  add_library(CLI11::CLI11 INTERFACE IMPORTED GLOBAL)
  target_include_directories(CLI11::CLI11 SYSTEM INTERFACE "${_bundle}/cli11/include")
  _ddp_bundle_version(libcli11-dev _version)
  _ddp_bundle_config(CLI11 ${_version})
  _ddp_bundle_note(CLI11 "the bundle's ${_version} (${_bundle}/cli11)")
endif()

# nlohmann_json (the benchmark, the timeline test: find_package(nlohmann_json 3 REQUIRED)).
find_package(nlohmann_json 3 QUIET)
if(nlohmann_json_FOUND)
  _ddp_bundle_note(nlohmann_json "the system's (${nlohmann_json_DIR})")
else()
  add_library(nlohmann_json::nlohmann_json INTERFACE IMPORTED GLOBAL)
  target_include_directories(nlohmann_json::nlohmann_json SYSTEM INTERFACE "${_bundle}/nlohmann_json/include")
  _ddp_bundle_version(nlohmann-json3-dev _version)
  _ddp_bundle_config(nlohmann_json ${_version})
  _ddp_bundle_note(nlohmann_json "the bundle's ${_version} (${_bundle}/nlohmann_json)")
endif()

# GoogleTest (the tests: find_package(GTest REQUIRED), whose FindGTest takes a config file first).
find_package(GTest QUIET)
if(GTest_FOUND)
  _ddp_bundle_note(GoogleTest "the system's")
elseif(DDP_BUILD_TESTS)
  set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
  set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
  add_subdirectory("${_bundle}/googletest" "${CMAKE_BINARY_DIR}/deps-bundle/googletest-build" EXCLUDE_FROM_ALL)
  foreach(_target gtest gtest_main)  # GoogleTest 1.12 makes these aliases itself, older ones do not
    if(NOT TARGET GTest::${_target})
      add_library(GTest::${_target} ALIAS ${_target})
    endif()
  endforeach()
  _ddp_bundle_version(googletest _version)
  _ddp_bundle_config(GTest ${_version})
  _ddp_bundle_note(GoogleTest "built from the bundle's ${_version} sources (${_bundle}/googletest)")
endif()

# Gloo's headers: beside LibTorch's own (an official LibTorch zip ships them), else the system's.
find_path(DDP_SYSTEM_GLOO_INCLUDE_DIR gloo/config.h HINTS ${TORCH_INCLUDE_DIRS})
if(DDP_SYSTEM_GLOO_INCLUDE_DIR)
  _ddp_bundle_note(Gloo "headers: ${DDP_SYSTEM_GLOO_INCLUDE_DIR}")
else()
  set(DDP_GLOO_INCLUDE_DIR "${_bundle}/gloo/include")
  _ddp_bundle_note(Gloo "headers: the bundle's (${DDP_GLOO_INCLUDE_DIR}); the code is LibTorch's own")
endif()

# zlib and OpenSSL's libcrypto: the bundle's headers, the system's shared library by its soname.
find_package(ZLIB QUIET)
if(ZLIB_FOUND)
  _ddp_bundle_note(zlib "the system's (${ZLIB_LIBRARIES})")
else()
  find_library(DDP_SYSTEM_LIBZ NAMES libz.so.1 z)
  if(NOT DDP_SYSTEM_LIBZ)
    message(FATAL_ERROR "torchddp: no libz.so.1 on this system (not even without zlib's headers): set DDP_SYSTEM_LIBZ")
  endif()
  if(NOT ZLIB_INCLUDE_DIR)
    set(ZLIB_INCLUDE_DIR "${_bundle}/zlib/include" CACHE PATH "" FORCE)
  endif()
  set(ZLIB_LIBRARY "${DDP_SYSTEM_LIBZ}" CACHE FILEPATH "" FORCE)
  set(ZLIB_LIBRARY_RELEASE "${DDP_SYSTEM_LIBZ}" CACHE FILEPATH "" FORCE)
  _ddp_bundle_note(zlib "headers ${ZLIB_INCLUDE_DIR}, library ${DDP_SYSTEM_LIBZ}")
endif()
find_package(OpenSSL QUIET COMPONENTS Crypto)
if(OpenSSL_FOUND)
  _ddp_bundle_note(OpenSSL "the system's (${OPENSSL_CRYPTO_LIBRARY})")
else()
  find_library(DDP_SYSTEM_LIBCRYPTO NAMES libcrypto.so.3 crypto)
  if(NOT DDP_SYSTEM_LIBCRYPTO)
    message(FATAL_ERROR "torchddp: no libcrypto.so.3 (OpenSSL 3) on this system, which ddprun links to: "
                        "set DDP_SYSTEM_LIBCRYPTO to one")
  endif()
  if(NOT OPENSSL_INCLUDE_DIR)
    set(OPENSSL_INCLUDE_DIR "${_bundle}/openssl/include" CACHE PATH "" FORCE)
  endif()
  set(OPENSSL_CRYPTO_LIBRARY "${DDP_SYSTEM_LIBCRYPTO}" CACHE FILEPATH "" FORCE)
  _ddp_bundle_note(OpenSSL "headers ${OPENSSL_INCLUDE_DIR}, library ${DDP_SYSTEM_LIBCRYPTO}")
endif()
unset(_version)
