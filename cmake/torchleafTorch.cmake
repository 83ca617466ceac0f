# Shared by torchleaf's own build (CMakeLists.txt) and its installed CMake
# package (torchleafConfig.cmake), so that both find libtorch the same way.

# torchleaf_skip_torch_cuda_lookup(): call before find_package(Torch).
#
# A CUDA build of torch (the package index's default Linux wheel, installed on
# GPU-less machines too) makes find_package(Torch) run Caffe2's
# public/cuda.cmake, which wants a CUDA toolkit (nvcc, headers) and without
# one stops the configure: "Your installed Caffe2 version uses CUDA but I
# cannot find the CUDA libraries". torchleaf compiles no CUDA code and calls
# no CUDA API; libtorch_cuda loads its CUDA runtime itself (the nvidia-*
# wheels, through its own RUNPATH). cuda.cmake returns at once when the target
# it defines, torch::cudart, already exists, and torch::cudart is the only CUDA
# target that torch's exported targets (c10_cuda, torch_cuda) link; an empty
# one declared first skips the toolkit lookup and links nothing extra. A CPU
# build of torch never reads it.
#
# A project that compiles CUDA code itself and wants PyTorch's CUDA setup
# finds Torch before torchleaf (nothing here runs then), or sets
# TORCHLEAF_TORCH_CUDA_LOOKUP=ON.
macro(torchleaf_skip_torch_cuda_lookup)
  if(NOT TARGET torch AND NOT TARGET torch::cudart AND NOT TORCHLEAF_TORCH_CUDA_LOOKUP)
    add_library(torch::cudart INTERFACE IMPORTED)
  endif()
endmacro()

# torchleaf_torch_cxx_standard(VAR): after find_package(Torch), sets VAR to the
# C++ standard the found torch's headers need: 20 from PyTorch 2.14 (ATen.h:
# "C++20 or later required"; TorchConfig's CXX_STANDARD 20 on its imported
# target reaches no consumer), 17 before.
function(torchleaf_torch_cxx_standard var)
  set(version "${Torch_VERSION}")
  if(NOT version)
    # No TorchConfigVersion.cmake: the version header.
    foreach(dir IN LISTS TORCH_INCLUDE_DIRS)
      foreach(header torch/headeronly/version.h torch/version.h)
        if(NOT version AND EXISTS "${dir}/${header}")
          file(STRINGS "${dir}/${header}" lines REGEX "#define TORCH_VERSION_(MAJOR|MINOR) ")
          string(REGEX REPLACE ".*MAJOR ([0-9]+).*MINOR ([0-9]+).*" "\\1.\\2" version "${lines}")
        endif()
      endforeach()
    endforeach()
  endif()
  if(NOT version MATCHES "^[0-9]+\\.[0-9]+")
    message(FATAL_ERROR "torchleaf: cannot tell the version of the torch found at ${Torch_DIR}")
  endif()
  if(version VERSION_GREATER_EQUAL 2.14)
    set(${var} 20 PARENT_SCOPE)
  else()
    set(${var} 17 PARENT_SCOPE)
  endif()
endfunction()
