# Installs the library, its headers and a CMake package so that `find_package(accelerate)` works.
include(CMakePackageConfigHelpers)

install(TARGETS accelerate accelerate_cli
        EXPORT accelerateTargets
        ARCHIVE DESTINATION ${CMAKE_INSTALL_LIBDIR}
        LIBRARY DESTINATION ${CMAKE_INSTALL_LIBDIR}
        RUNTIME DESTINATION ${CMAKE_INSTALL_BINDIR})
# Every `accelerate` command but launch (Note [The launcher without LibTorch]).
install(TARGETS accelerate_commands RUNTIME DESTINATION ${CMAKE_INSTALL_LIBEXECDIR}/accelerate-cpp)
install(DIRECTORY include/accelerate DESTINATION ${CMAKE_INSTALL_INCLUDEDIR})
install(EXPORT accelerateTargets NAMESPACE accelerate::
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/accelerate)
configure_package_config_file(cmake/accelerateConfig.cmake.in
                              ${CMAKE_CURRENT_BINARY_DIR}/accelerateConfig.cmake
                              INSTALL_DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/accelerate)
write_basic_package_version_file(${CMAKE_CURRENT_BINARY_DIR}/accelerateConfigVersion.cmake
                                 COMPATIBILITY SameMinorVersion)
install(FILES ${CMAKE_CURRENT_BINARY_DIR}/accelerateConfig.cmake
              ${CMAKE_CURRENT_BINARY_DIR}/accelerateConfigVersion.cmake
        DESTINATION ${CMAKE_INSTALL_LIBDIR}/cmake/accelerate)
