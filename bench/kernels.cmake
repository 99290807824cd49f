# bench_kernels: forward/backward GFLOP/s of the blockwise kernels next to a measured sgemm rate.
# See docs/performance.md, "Kernels: first numbers (issue 2)".
add_executable(bench_kernels ${CMAKE_CURRENT_LIST_DIR}/bench_kernels.cc)
target_link_libraries(bench_kernels PRIVATE loom_kernels OpenMP::OpenMP_CXX CLI11::CLI11
                                            nlohmann_json::nlohmann_json)
# --torch runs this script (PyTorch eager on the same shapes) from the source tree.
target_compile_definitions(bench_kernels
                           PRIVATE LOOM_TORCH_COMPARE="${CMAKE_CURRENT_LIST_DIR}/torch_compare.py")

# The sgemm comparison uses OpenBLAS's cblas_sgemm when BLAS is OpenBLAS and its own cblas.h is
# found (its thread count is set with openblas_set_num_threads); otherwise a naive blocked sgemm.
set(loom_bench_openblas OFF)
if(BLAS_FOUND AND BLAS_LIBRARIES MATCHES "openblas")
  find_path(LOOM_OPENBLAS_INCLUDE_DIR NAMES openblas_config.h
            PATHS /usr/include/x86_64-linux-gnu/openblas-pthread
                  /usr/include/x86_64-linux-gnu/openblas-openmp
                  /usr/include/aarch64-linux-gnu/openblas-pthread
                  /usr/include/openblas /usr/local/include/openblas /opt/homebrew/opt/openblas/include
            NO_DEFAULT_PATH)
  if(LOOM_OPENBLAS_INCLUDE_DIR AND EXISTS "${LOOM_OPENBLAS_INCLUDE_DIR}/cblas.h")
    set(loom_bench_openblas ON)
  endif()
endif()
if(loom_bench_openblas)
  target_include_directories(bench_kernels PRIVATE ${LOOM_OPENBLAS_INCLUDE_DIR})
  target_link_libraries(bench_kernels PRIVATE ${BLAS_LIBRARIES})
  target_compile_definitions(bench_kernels PRIVATE LOOM_BENCH_OPENBLAS=1)
endif()
message(STATUS "loom: bench_kernels sgemm from OpenBLAS: ${loom_bench_openblas}")

# ggml_compare (optional): ggml's CPU flash attention (ggml_flash_attn_ext) on bench_kernels'
# shapes, which bench_kernels then runs for its `ggml` rows. ggml is not in Debian: it is built
# only when LOOM_GGML_DIR names the install prefix of a ggml build (its lib/cmake/ggml), e.g.
#   cmake -S ggml -B ggml/build -DGGML_NATIVE=ON -DCMAKE_INSTALL_PREFIX=/opt/ggml && ...install
#   cmake -S . -B build -DLOOM_GGML_DIR=/opt/ggml
set(LOOM_GGML_DIR "" CACHE PATH "Install prefix of a ggml build, for bench_kernels' ggml rows")
if(LOOM_GGML_DIR)
  find_package(ggml CONFIG REQUIRED PATHS ${LOOM_GGML_DIR} NO_DEFAULT_PATH)
  add_executable(ggml_compare ${CMAKE_CURRENT_LIST_DIR}/ggml_compare.cc)
  target_link_libraries(ggml_compare PRIVATE loom_kernels ggml::ggml CLI11::CLI11
                                             nlohmann_json::nlohmann_json)
  set_target_properties(ggml_compare PROPERTIES BUILD_RPATH "${LOOM_GGML_DIR}/lib")
  target_compile_definitions(bench_kernels PRIVATE LOOM_GGML_COMPARE="$<TARGET_FILE:ggml_compare>")
  add_dependencies(bench_kernels ggml_compare)
endif()
message(STATUS "loom: bench_kernels ggml rows: ${LOOM_GGML_DIR}")
