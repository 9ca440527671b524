# LibTorch for the build (the part shared with installed packages: dtrainFindTorch.cmake), and
# what only this build needs: a PyPI wheel ships protobuf headers of its own, which would shadow
# the system's for the generated gRPC code.
include(${CMAKE_CURRENT_LIST_DIR}/dtrainFindTorch.cmake)

# The wheel's protobuf headers: its targets get a copy of its include folder without google/
# (symbolic links), so the system's protobuf is the one the generated gRPC code sees. Debian's
# LibTorch (headers in /usr/include) is left as it is.
set(DTRAIN_TORCH_INCLUDE "${TORCH_INSTALL_PREFIX}/include")
if(EXISTS "${DTRAIN_TORCH_INCLUDE}/google/protobuf" AND
   NOT DTRAIN_TORCH_INCLUDE STREQUAL "/usr/include")
  set(DTRAIN_TORCH_SHIM "${CMAKE_BINARY_DIR}/torch-include")
  file(MAKE_DIRECTORY "${DTRAIN_TORCH_SHIM}")
  file(GLOB DTRAIN_TORCH_ENTRIES RELATIVE "${DTRAIN_TORCH_INCLUDE}" "${DTRAIN_TORCH_INCLUDE}/*")
  foreach(entry ${DTRAIN_TORCH_ENTRIES})
    if(NOT entry STREQUAL "google" AND NOT EXISTS "${DTRAIN_TORCH_SHIM}/${entry}")
      file(CREATE_LINK "${DTRAIN_TORCH_INCLUDE}/${entry}" "${DTRAIN_TORCH_SHIM}/${entry}" SYMBOLIC)
    endif()
  endforeach()
  foreach(target torch torch_cpu torch_cuda c10 c10_cuda)
    if(TARGET ${target})
      get_target_property(dirs ${target} INTERFACE_INCLUDE_DIRECTORIES)
      if(dirs)
        list(TRANSFORM dirs REPLACE "^${DTRAIN_TORCH_INCLUDE}$" "${DTRAIN_TORCH_SHIM}")
        set_target_properties(${target} PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${dirs}")
      endif()
    endif()
  endforeach()
  list(TRANSFORM TORCH_INCLUDE_DIRS REPLACE "^${DTRAIN_TORCH_INCLUDE}$" "${DTRAIN_TORCH_SHIM}")
  # A wheel compiles gloo into libtorch_cpu but ships none of the gloo headers that
  # ProcessGroupGloo.hpp includes: third_party/gloo holds a copy close to the one it bundles.
  set(DTRAIN_GLOO_INCLUDE "${CMAKE_CURRENT_LIST_DIR}/../third_party/gloo/include")
  get_filename_component(DTRAIN_GLOO_INCLUDE "${DTRAIN_GLOO_INCLUDE}" ABSOLUTE)
  foreach(target torch torch_cpu)
    if(TARGET ${target})
      target_include_directories(${target} SYSTEM BEFORE INTERFACE "${DTRAIN_GLOO_INCLUDE}")
    endif()
  endforeach()
  list(APPEND TORCH_INCLUDE_DIRS "${DTRAIN_GLOO_INCLUDE}")
endif()
