# `cmake --install`: the library, its public headers, a CMake package (find_package(dsyncps
# CONFIG) -> dsyncps::dsyncps), a pkg-config file, the dsyncps program and the Python
# package; `cpack -G DEB` packs the same. Only include/dsync is public: src/ is not installed.
include(CMakePackageConfigHelpers)

set(_cmake_dir ${CMAKE_INSTALL_LIBDIR}/cmake/dsyncps)
set_target_properties(dsync_nccl PROPERTIES OUTPUT_NAME dsyncps_nccl EXPORT_NAME nccl)
install(TARGETS dsync dsync_nccl EXPORT dsyncpsTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        INCLUDES DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(DIRECTORY ${PROJECT_SOURCE_DIR}/include/dsync DESTINATION ${CMAKE_INSTALL_INCLUDEDIR}
        FILES_MATCHING PATTERN "*.h")
install(EXPORT dsyncpsTargets NAMESPACE dsyncps:: DESTINATION ${_cmake_dir})
configure_package_config_file(${CMAKE_CURRENT_LIST_DIR}/dsyncpsConfig.cmake.in
                              ${PROJECT_BINARY_DIR}/dsyncpsConfig.cmake
                              INSTALL_DESTINATION ${_cmake_dir})
# 0.x: a minor release may change the API.
write_basic_package_version_file(${PROJECT_BINARY_DIR}/dsyncpsConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${PROJECT_BINARY_DIR}/dsyncpsConfig.cmake
              ${PROJECT_BINARY_DIR}/dsyncpsConfigVersion.cmake
        DESTINATION ${_cmake_dir})

# pkg-config: relocatable (the prefix is found from the file's own place).
file(RELATIVE_PATH DSYNC_PC_UP /x/${CMAKE_INSTALL_LIBDIR}/pkgconfig /x)
string(REGEX REPLACE "/$" "" DSYNC_PC_UP "${DSYNC_PC_UP}")
set(DSYNC_PC_REQUIRES "")
set(DSYNC_PC_LIBS "")
if(DSYNC_HAVE_RDMA)
  string(APPEND DSYNC_PC_REQUIRES " libibverbs librdmacm")
endif()
if(DSYNC_HAVE_NVCC)
  string(APPEND DSYNC_PC_LIBS " -L${CUDAToolkit_LIBRARY_DIR} -lcudart_static -ldl -lrt")
endif()
configure_file(${CMAKE_CURRENT_LIST_DIR}/dsyncps.pc.in ${PROJECT_BINARY_DIR}/dsyncps.pc @ONLY)
install(FILES ${PROJECT_BINARY_DIR}/dsyncps.pc DESTINATION ${CMAKE_INSTALL_LIBDIR}/pkgconfig)

install(TARGETS dsyncps RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})

# The Python package, where the interpreter it was built for looks. Empty
# DSYNC_PYTHON_INSTALL_DIR: decided at install time from the prefix, because Debian's python3
# reads /usr/lib/python3/dist-packages for packages of the system (a .deb's /usr) but
# /usr/local/lib/python3.X/dist-packages for local installs; other interpreters read
# <prefix>/lib/python3.X/site-packages.
if(TARGET _core)
  set(DSYNC_PYTHON_INSTALL_DIR "" CACHE STRING
      "Where the Python package goes, relative to the prefix (empty: the interpreter's place for the prefix)")
  execute_process(
    COMMAND ${DSYNC_PYTHON_EXECUTABLE} -c
            "import sys; print('%d.%d' % sys.version_info[:2]); print('dist' if '/usr/lib/python3/dist-packages' in sys.path else 'site')"
    OUTPUT_VARIABLE _py OUTPUT_STRIP_TRAILING_WHITESPACE)
  string(REPLACE "\n" ";" _py "${_py}")
  list(GET _py 0 _py_version)
  list(GET _py 1 _py_kind)
  set(DSYNC_PYTHON_DEFAULT_DIR "lib/python${_py_version}/${_py_kind}-packages")
  list(TRANSFORM DSYNC_PYTHON_SOURCES PREPEND ${PROJECT_SOURCE_DIR}/python/dsyncps/
       OUTPUT_VARIABLE _py_files)
  install(CODE "
    set(_dir \"${DSYNC_PYTHON_INSTALL_DIR}\")
    if(NOT _dir)
      if(CMAKE_INSTALL_PREFIX STREQUAL \"/usr\" AND \"${_py_kind}\" STREQUAL \"dist\")
        set(_dir lib/python3/dist-packages)
      else()
        set(_dir ${DSYNC_PYTHON_DEFAULT_DIR})
      endif()
    endif()
    file(INSTALL DESTINATION \"\${CMAKE_INSTALL_PREFIX}/\${_dir}/dsyncps\" TYPE FILE
         FILES ${_py_files})
    file(INSTALL DESTINATION \"\${CMAKE_INSTALL_PREFIX}/\${_dir}/dsyncps\" TYPE MODULE
         FILES \"$<TARGET_FILE:_core>\")
  ")
endif()

set(CPACK_PACKAGE_NAME dsyncps)
set(CPACK_PACKAGE_VENDOR "dsyncps")
set(CPACK_PACKAGE_DESCRIPTION_SUMMARY
    "Parameter server with delayed synchronization: library, headers, CLI and Python package")
set(CPACK_PACKAGE_CONTACT "dsyncps maintainers <dsyncps@localhost>")
set(CPACK_PACKAGE_VERSION ${PROJECT_VERSION})
set(CPACK_DEBIAN_FILE_NAME DEB-DEFAULT)
set(CPACK_PACKAGING_INSTALL_PREFIX /usr)
set(CPACK_DEBIAN_PACKAGE_SECTION science)
# The shared libraries the program and module load (libsodium, fmt, spdlog, verbs) become
# Depends through dpkg-shlibdeps; the headers' and the Python package's needs are named.
find_program(DSYNC_DPKG_SHLIBDEPS dpkg-shlibdeps)
if(DSYNC_DPKG_SHLIBDEPS)
  set(CPACK_DEBIAN_PACKAGE_SHLIBDEPS ON)
endif()
set(CPACK_DEBIAN_PACKAGE_DEPENDS "python3")
set(CPACK_DEBIAN_PACKAGE_RECOMMENDS "python3-torch, libfmt-dev, libspdlog-dev, nlohmann-json3-dev, libsodium-dev")
include(CPack)
