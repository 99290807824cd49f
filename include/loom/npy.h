// loom/npy.h: reading and writing NumPy .npy files (format 1.0-3.0).
//
// Accepted on read: dtype '<f4' or '<f8' (and '<i4', '<i8' for read_npy_index), C order. Anything
// else (Fortran order, big-endian, another dtype, a truncated file, a header whose shape does
// not match the data size, a malformed header, a shape that is not the Python tuple numpy writes:
// "(2, 3)", "(6,)" or "()", a trailing comma allowed; "(2 3)" and "(2)" are refused as numpy
// refuses them) raises IoError with one line naming the file.
// Reads check the header before the body: a file without the magic, with a header longer than
// 1 MiB, or whose declared data size differs from the file's size is refused before its data is
// read; directories, FIFOs and devices are refused without blocking (loom/io.h InputFile).
// Writes go through write_output (loom/io.h): atomic for regular files and missing paths (temp
// file + rename, so a failed run never leaves a file that looks whole), direct for devices,
// FIFOs and "-", symlinks followed.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "loom/tensor.h"

namespace loom {

// Reads an f4 or f8 array, converting to float. Returns the array with its shape. A finite f8
// value beyond float32's range (|x| > 3.40282e38) raises IoError naming it and its index.
Tensor<float> read_npy_f32(const std::string& path);
// Reads an f4 or f8 array, converting to double.
Tensor<double> read_npy_f64(const std::string& path);
// The shape of an f4 or f8 array, with every check of read_npy_f64 (magic, header, dtype, the
// body's size against the file's), without reading the body: a caller sizes its memory first.
std::vector<int64_t> read_npy_shape(const std::string& path);

// Reads a 1-d index array (cu_seqlens, as torch and NumPy write it): '<i4' or '<i8', or '<f4' /
// '<f8' holding whole numbers that fit int64, with the same checks as read_npy_f64 (header
// before body, regular files only). Throws IoError naming the file.
std::vector<int64_t> read_npy_index(const std::string& path);

// Parses an in-memory .npy image (used by the reader and the fuzz target); `what` names the
// source in error messages.
Tensor<double> parse_npy(const uint8_t* bytes, size_t size, const std::string& what);

// The shape of an array for a role, from its header alone (the body is not read): e.g.
// expect_rank = 3 for q/k/v. Throws IoError naming the role ("q.npy has shape [4, 2] but q must
// be [S, H, D]"); read the body with read_npy_f32.
std::vector<int64_t> read_npy_role_shape(const std::string& path, const std::string& role,
                                         int expect_rank);

// Writes x as '<f4' / '<f8' with its shape. A tensor whose element count is not its shape's
// (a default-constructed Tensor: shape [] but no element; a vec() resized by hand) is refused
// with InvalidArgument before anything is written: its file would be unreadable.
void write_npy(const std::string& path, const Tensor<float>& x);
void write_npy(const std::string& path, const Tensor<double>& x);

// Writes `bytes` to path with write_output's rules (loom/io.h). Throws IoError.
void write_file_atomic(const std::string& path, const std::string& bytes);

}  // namespace loom
