// Precompiled for every translation unit of the library: ATen is most of our compile time.
#pragma once
#include <ATen/ATen.h>
#include <torch/script.h>
#include <fmt/format.h>
#include <fmt/ranges.h>  // fmt::join (fmt 12, the wheel's copy)
#include <mpi.h>

#include <map>
#include <memory>
#include <string>
#include <vector>
